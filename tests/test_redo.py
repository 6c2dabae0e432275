"""--redo failed,length: only the requests that failed or were cut run again, with the job's current generation
settings; every id stays in the shards exactly once with its latest answer, after kill -9 during a redo, after
merge, and for split jobs; run.json keeps the history."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl


@pytest.fixture
def prompts(tmp_path):
    rows = [{"id": f"q{i:02d}", "prompt": f"Tell me a long story about the number {i}."} for i in range(12)]
    rows.append({"id": "bad", "prompt": ""})  # an input error: failed, and fails again when redone
    return write_jsonl(tmp_path / "p.jsonl", rows)


def run(tiny_model_dir, prompts, out, *flags) -> int:
    return run_cli(["run", str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "-q", *map(str, flags)])


def rows_by_id(out) -> dict[str, dict]:
    rows = list(read_shards(out))
    counts = Counter(r["id"] for r in rows)
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1]  # every id exactly once
    return {r["id"]: r for r in rows}


def test_redo_length_runs_only_the_cut_requests_with_the_new_cap(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    assert run(tiny_model_dir, prompts, out, "--max-new-tokens", 3) == 1  # the bad row
    before = rows_by_id(out)
    cut = {k for k, r in before.items() if r["finish_reason"] == "length"}
    assert cut and "bad" not in cut
    assert run(tiny_model_dir, prompts, out, "--max-new-tokens", 9, "--redo", "length") == 1
    after = rows_by_id(out)
    assert after.keys() == before.keys()
    for key in cut:  # greedy: the longer answers start with the cut ones
        assert after[key]["token_ids"][:3] == before[key]["token_ids"] and len(after[key]["token_ids"]) > 3
    assert after["bad"] == before["bad"]  # not cut: left alone
    manifest = json.loads((out / "run.json").read_text())
    redo = manifest["redos"][-1]
    assert (redo["redo"], redo["requests"], redo["rows"], redo["finished"]) == (["length"], len(cut), len(cut), True)
    assert redo["changed"] == {"max_new_tokens": [3, 9]}
    # and the fingerprint now holds the new settings: a plain resume with them is the same job
    assert run(tiny_model_dir, prompts, out, "--max-new-tokens", 9) == 1


def test_redo_failed_and_settings_that_must_match(tiny_model_dir, prompts, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(tiny_model_dir, prompts, out, "--max-new-tokens", 4, "--request-timeout", 0.0001) == 1
    before = rows_by_id(out)
    assert any("timed out" in (r["error"] or "") for r in before.values())
    assert run(tiny_model_dir, prompts, out, "--max-new-tokens", 4, "--redo", "failed", "--keep-columns",
               "prompt") == 2  # not a generation setting: another job
    assert "holds a run of a different job (keep_columns" in capsys.readouterr().err
    assert run(tiny_model_dir, prompts, out, "--max-new-tokens", 4, "--redo", "failed,length") == 1
    after = rows_by_id(out)
    assert {k for k, r in after.items() if r["error"]} == {"bad"}  # the timeouts are answered now
    redone = {k for k, r in before.items() if r["finish_reason"] in ("error", "length")}
    assert json.loads((out / "run.json").read_text())["redos"][-1]["requests"] == len(redone)
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "new"), "--redo", "failed"]) == 2
    assert "--redo generates part of an earlier run again" in capsys.readouterr().err


@pytest.mark.slow
def test_kill_9_during_a_redo_then_the_same_command_finishes_it(tiny_model_dir, tmp_path):
    rows = [{"id": f"r{i:02d}", "prompt": f"Count to {i}, slowly."} for i in range(40)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    common = [str(path), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "--rows-per-shard",
              "2", "--commit-interval", "0.05", "-q"]
    assert run_cli(["run", *common, "--max-new-tokens", "2"]) == 0
    redo = [*common, "--max-new-tokens", "24", "--redo", "length"]
    process = subprocess.Popen([sys.executable, "-m", "cbgen", "run", *redo], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # every row was cut, so the redo takes out every shard; kill it once it has committed new ones
    while not (list(out.glob("part-*.jsonl")) and (out / "fingerprint.json").read_text().count('"finished": false')):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert 0 < len(rows_by_id(out)) < len(rows)  # part-way: the rest are missing, none twice
    assert run_cli(["run", *redo]) == 0
    after = rows_by_id(out)
    assert sorted(after) == sorted(r["id"] for r in rows)
    assert all(len(r["token_ids"]) > 2 for r in after.values())  # every answer is the redo's
    history = json.loads((out / "run.json").read_text())["redos"]
    assert len(history) == 1 and history[0]["finished"] and history[0]["requests"] == len(rows)  # resumed, once


@pytest.mark.slow
def test_a_split_job_is_redone_shard_by_shard_and_merges(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    for index in (0, 1):
        assert run(tiny_model_dir, prompts, out, "--max-new-tokens", 3, "--num-shards", 2, "--shard-index",
                   index) in (0, 1)
    for index in (0, 1):
        assert run(tiny_model_dir, prompts, out, "--max-new-tokens", 6, "--num-shards", 2, "--shard-index", index,
                   "--redo", "length") in (0, 1)
    assert run_cli(["merge", str(out)]) == 0
    merged = rows_by_id(out / "merged")
    assert len(merged) == 13 and all(len(r["token_ids"]) > 3 for k, r in merged.items() if k != "bad")
