"""What `cbgen run` prints: plain progress lines and the summary table, in good English for any count."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from cbgen.cli.display import PlainProgress, summary_table
from cbgen.outputs.summary import RunSummary


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


def test_scoring_progress_counts_every_token_it_computes(monkeypatch):
    """A scoring job computes each row's prompt and what it scores: 80 rows of ~150 tokens read "9.1 scored tok/s"
    when only the scored choice tokens counted. The line says what it counts, and counts both."""
    import cbgen.cli.display as display

    clock = iter([100.0, 100.0, 104.0, 104.0, 104.0])
    monkeypatch.setattr(display.time, "perf_counter", lambda: next(clock, 104.0))
    out = io.StringIO()
    progress = PlainProgress(Console(file=out, width=200), interval=0.0)
    progress.start(80, "row", verb="scoring")
    progress.advance(2, 300, 2, 0)  # two rows: 150 prompt tokens and one scored token each
    line = out.getvalue().splitlines()[-1]
    assert "2/80 rows, 75.5 computed tok/s (every token read)" in line  # 302 tokens in 4 s
    generating = PlainProgress(Console(file=io.StringIO(), width=200))
    generating.start(4, "sequence")
    assert generating.counters.rate_label == "generated tok/s"
