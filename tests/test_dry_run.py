"""`cbgen run --dry-run`: every row read and rendered with the tokenizer only, the error records and prompt tokens
the job would have, and the KV cache it would reserve, as the real run then has them; no model weights, no output."""

from __future__ import annotations

import json

import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl


@pytest.fixture
def prompts(tmp_path):
    rows = [{"id": f"q{i}", "prompt": f"Tell me about {i}." + " More." * i} for i in range(9)]
    rows += [{"id": "empty", "prompt": " "}, {"id": "cap", "prompt": "x", "max_new_tokens": 0},
             {"id": "long", "input_ids": [7] * 300}]  # the tiny model's context is 256
    return write_jsonl(tmp_path / "p.jsonl", rows)


def dry(tiny_model_dir, prompts, tmp_path, capsys, *flags):
    capsys.readouterr()
    code = run_cli(["run", str(prompts), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir),
                    "--max-new-tokens", "5", "--dry-run", "--json", *map(str, flags)])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_the_report_is_what_the_run_then_does(tiny_model_dir, prompts, tmp_path, capsys, monkeypatch):
    import cbgen.model.load as load

    real = load.load_model
    calls = []
    monkeypatch.setattr(load, "load_model", lambda *a, **k: calls.append(k.get("weights", True)) or real(*a, **k))
    report = dry(tiny_model_dir, prompts, tmp_path, capsys)
    assert calls == [False]  # the tokenizer and the model's structure, never its weights
    assert not (tmp_path / "out").exists()  # nothing written
    assert (report["rows"], report["errors"]) == (12, 3)
    assert any("p.jsonl:12" in e and "context" in e for e in report["first_errors"])
    assert report["max_sequences"] == 9 and report["max_generated_tokens"] == 45
    assert report["estimate"] is None
    monkeypatch.setattr(load, "load_model", real)
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir),
                    "--max-new-tokens", "5", "-q"]) == 1
    rows = list(read_shards(tmp_path / "out"))
    assert sum(r["error"] is not None for r in rows) == report["errors"]
    assert sum(r["num_prompt_tokens"] for r in rows) == report["prompt_tokens"]
    assert max(r["num_prompt_tokens"] for r in rows) == report["longest_prompt"]
    reserved = json.loads((tmp_path / "out" / "run.json").read_text())["kv_cache"]
    planned = report["kv_cache"]
    assert (reserved["num_blocks"], reserved["bytes"]) == (planned["num_blocks"], planned["bytes"])


def test_the_estimate_says_how(tiny_model_dir, prompts, tmp_path, capsys):
    report = dry(tiny_model_dir, prompts, tmp_path, capsys, "--estimate-time")
    estimate = report["estimate"]
    assert estimate["sample_requests"] == 9 and estimate["estimated_generation_s"] > 0
    assert "the first 9 runnable requests generated on the real model" in estimate["how"]
    assert not (tmp_path / "out").exists()


def test_the_flags_that_go_with_it(tiny_model_dir, prompts, tmp_path, capsys):
    assert run_cli(["run", str(prompts), "--model", str(tiny_model_dir), "--estimate-time"]) == 2
    assert "--estimate-time and --json go with --dry-run" in capsys.readouterr().err
    assert run_cli(["run", str(prompts), "--model", str(tiny_model_dir), "--dry-run"]) == 0
    assert "error records it would write" in capsys.readouterr().out
