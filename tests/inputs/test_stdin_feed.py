"""A job that reads stdin: its ids checked as the rows stream (a duplicate ends the job there, the rows before it
kept), and a resume only where the user says the feed is the same one (a stream has no identity to compare)."""

from __future__ import annotations

import io
import json
import sys

from cbgen.cli import run_cli
from cbgen.rows import read_shards


def _feed(monkeypatch, rows) -> None:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def _run(tiny_model_dir, out, *flags) -> int:
    return run_cli(["run", "-", "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "--max-new-tokens", "3", "-q", *flags])


def test_a_duplicate_id_on_stdin_is_refused_before_anything_runs_when_read_ahead(tiny_model_dir, tmp_path, monkeypatch,
                                                                            capsys):
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"},
            {"id": "c", "prompt": "w"}]
    _feed(monkeypatch, rows)
    out = tmp_path / "out"
    code = _run(tiny_model_dir, out)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "<stdin>:3: duplicate id 'a' (first seen on line 1)" in err and "Traceback" not in err
    assert list(read_shards(out)) == []  # the rows read ahead to plan the job held it: nothing ran


def test_a_stdin_job_resumes_only_when_told_the_feed_is_the_same(tiny_model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    _feed(monkeypatch, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    assert _run(tiny_model_dir, out) == 0
    capsys.readouterr()
    _feed(monkeypatch, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "c", "prompt": "z"}])
    assert _run(tiny_model_dir, out) == 2
    err = capsys.readouterr().err
    assert "holds a run of a job that read stdin" in err and "--same-input" in err
    assert sorted(r["id"] for r in read_shards(out)) == ["a", "b"]  # untouched
    _feed(monkeypatch, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "c", "prompt": "z"}])
    assert _run(tiny_model_dir, out, "--same-input") == 0
    manifest = json.loads((out / "run.json").read_text())
    assert sorted(r["id"] for r in read_shards(out)) == ["a", "b", "c"]
    assert manifest["counts"]["resumed_requests"] == 2


def test_a_duplicate_past_the_read_ahead_keeps_the_rows_written_before(tiny_model_dir, tmp_path, monkeypatch,
                                                                       capsys):
    from cbgen.render.prompts import LOOKAHEAD

    rows = [{"id": f"r{i}", "input_ids": [5 + i % 50]} for i in range(LOOKAHEAD + 40)] + [{"id": "r3", "prompt": "x"}]
    _feed(monkeypatch, rows)
    out = tmp_path / "out"
    code = run_cli(["run", "-", "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "--max-new-tokens", "1", "--rows-per-shard", "100", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and f"<stdin>:{LOOKAHEAD + 41}: duplicate id 'r3'" in err, err
    written = [r["id"] for r in read_shards(out)]
    assert len(written) == len(set(written)) and len(written) >= 100, len(written)
