"""What `cbgen run` prints: plain progress lines and the summary table, in good English for any count."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from cbgen.cli.display import PlainProgress, summary_table
from cbgen.summary import RunSummary


def printed(render) -> str:
    out = io.StringIO()
    render(Console(file=out, width=200, force_terminal=False))
    return out.getvalue()


def test_one_is_singular():
    summary = RunSummary(output_dir=Path("out"), model="m", requests=1, sequences=1, shards=["part-00000.jsonl"])
    text = printed(lambda console: console.print(summary_table(summary)))
    assert "1 (1 sequence)" in text and "(1 shard + run.json)" in text

    def progress(console):
        plain = PlainProgress(console)
        plain.start(1, "sequence")
        plain.advance(1, 10, 5, 0)
        plain.finish()

    text = printed(progress)
    assert "generating 1 sequence\n" in text and "1/1 sequence," in text


def test_many_are_plural():
    summary = RunSummary(output_dir=Path("out"), model="m", requests=2, sequences=4, shards=["a", "b"])
    text = printed(lambda console: console.print(summary_table(summary)))
    assert "2 (4 sequences)" in text and "(2 shards + run.json)" in text

    def progress(console):
        plain = PlainProgress(console)
        plain.start(3, "request")
        plain.advance(2, 10, 5, 0)
        plain.finish()

    text = printed(progress)
    assert "generating 3 requests\n" in text and "2/3 requests," in text
