"""Jobs that survive: resume exactly once after kill -9, graceful SIGTERM, locks, fingerprints, bad input, timeouts,
disk full, Slurm-style sharding and merge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from cbgen.rows.rundir import DirectoryLock
from tests.helpers import disk_full_at_shard, write_jsonl


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    rows = [{"id": f"r{i:03d}", "prompt": f"Tell me something about the number {i}." + " And more." * (i % 5)}
            for i in range(48)]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", rows)


def job_args(tiny_model_dir, prompts, out, *extra):
    return [str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "--id-column", "id",
            "--max-new-tokens", "24", "--max-in-flight", "4", "--rows-per-shard", "3", *map(str, extra)]


def cbgen(*args) -> int:
    return run_cli(["run", *map(str, args), "-q"])


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cbgen", "run", *args, "-q"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def by_id(out: Path) -> dict[str, list[int]]:
    rows = list(read_shards(out))
    counts = Counter(r["id"] for r in rows)
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1]
    return {r["id"]: r["token_ids"] for r in rows}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts, tmp_path_factory) -> dict[str, list[int]]:
    """The uninterrupted job's rows, once for the module: the tests compare theirs with it, none writes there."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 0
    return by_id(out)


def shards(out: Path) -> int:
    return len(list(out.glob("part-*.jsonl")))


def wait_until(condition, process: subprocess.Popen, timeout: float = 120) -> bool:
    """Waits for `condition()`; False when the process ended first (it then had nothing left to do)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the job made no progress in time"
        time.sleep(0.02)
    return True


def wait_for_shard(out: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not shards(out):
        assert time.monotonic() < deadline, "no shard was committed in time"
        time.sleep(0.05)


@pytest.mark.slow
def test_kill_9_at_each_stage_then_resume_exactly_once(tiny_model_dir, prompts, tmp_path, reference):
    """kill -9 once the run directory exists but before any shard (while the model loads), then three times as soon
    as a run has committed a shard more than the runs before it; a fifth run finishes the job."""
    out = tmp_path / "out"
    args = job_args(tiny_model_dir, prompts, out, "--commit-interval", 0.05)
    moments = [lambda before: (out / "fingerprint.json").exists()] + [lambda before: shards(out) > before] * 3
    for moment in moments:
        before = shards(out)
        process = start(args)
        assert wait_until(lambda m=moment, b=before: m(b), process), process.stderr.read()
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    assert 0 < shards(out) < len(reference) / 3  # killed part-way: rows of 3 per shard, 48 rows
    assert cbgen(*args) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["counts"]["resumed_requests"] > 0  # the last run really resumed
    assert manifest["counts"]["requests"] == len(reference)
    assert by_id(out) == reference  # every id exactly once, greedy tokens as in an uninterrupted run
    assert not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_sigterm_stops_gracefully_and_resumes(tiny_model_dir, prompts, tmp_path, reference):
    out = tmp_path / "out"
    args = job_args(tiny_model_dir, prompts, out, "--commit-interval", 0.05, "--max-new-tokens", 48)
    process = start(args)
    wait_for_shard(out)
    process.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    code = process.wait(timeout=60)
    assert code == 75, process.stderr.read()
    assert time.monotonic() - stopped_at < 30
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "stopped" and 0 < manifest["counts"]["requests"] < len(reference)
    assert run_cli(["run", *args, "-q"]) == 0
    longer = by_id(out)
    assert sorted(longer) == sorted(reference)
    for key, tokens in reference.items():  # greedy: the 48-token answers start with the 24-token ones
        assert longer[key][: len(tokens)] == tokens or len(longer[key]) < len(tokens)


def test_a_second_run_on_a_directory_in_use_is_refused(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    with DirectoryLock(out):
        assert run_cli(["run", *job_args(tiny_model_dir, prompts, out)]) == 2
    # the lock file a killed run leaves behind does not block: the kernel dropped its lock
    assert (out / ".cbgen.lock").exists()
    assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 0


def test_lock_message(tiny_model_dir, prompts, tmp_path, capsys):
    out = tmp_path / "out"
    with DirectoryLock(out):
        run_cli(["run", *job_args(tiny_model_dir, prompts, out)])
    assert f"output directory '{out}' is in use by cbgen pid {os.getpid()}" in capsys.readouterr().err


@pytest.mark.slow
def test_a_different_job_in_the_same_directory_is_refused(tiny_model_dir, prompts, tmp_path, capsys, reference):
    out = tmp_path / "out"
    assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 0
    assert cbgen(*job_args(tiny_model_dir, prompts, out), "--max-new-tokens", 5) == 2
    err = capsys.readouterr().err
    assert "holds a run of a different job (generation.max_new_tokens: 24 -> 5)" in err and "--overwrite" in err
    # batching settings change speed, not results: a resume may change them
    assert cbgen(*job_args(tiny_model_dir, prompts, out), "--page-size", 64) == 0
    assert cbgen(*job_args(tiny_model_dir, prompts, out), "--max-new-tokens", 5, "--overwrite") == 0
    assert all(len(tokens) <= 5 for tokens in by_id(out).values())


@pytest.mark.slow
def test_a_finished_job_reruns_without_loading_the_model(tiny_model_dir, prompts, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 0
    before = by_id(out)
    monkeypatch.setattr("cbgen.model.load.load_model", lambda *a: pytest.fail("the model was loaded"))
    assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 0
    assert by_id(out) == before


BAD_ROWS = [
    b'{"id": "bad-json", "prompt": "unterminated',
    b'["not", "an", "object"]',
    b'{"id": "bad-utf8", "prompt": "caf\xe9"}',
    b'{"id": "empty", "prompt": "   "}',
    b'{"id": "wrong-type", "prompt": 42}',
    b'{"id": "role", "messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"id": "no-prompt", "question": "where is the prompt?"}',
    b'{"id": "vocab", "input_ids": [1, 2, 999999999]}',
    b'{"id": "too-long", "input_ids": [' + b", ".join([b"7"] * 300) + b"]}",
    b'{"id": "over-kv", "input_ids": [' + b", ".join([b"8"] * 120) + b"]}",
]


def test_bad_input_corpus_never_sinks_the_job(tiny_model_dir, tmp_path):
    good = [json.dumps({"id": f"good{i}", "prompt": f"question {i}"}).encode() for i in range(6)]
    lines = [row for pair in zip(good, BAD_ROWS) for row in pair] + BAD_ROWS[len(good):]
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    code = cbgen(path, "-o", out, "--model", tiny_model_dir, "--id-column", "id", "--max-new-tokens", 4,
                 "--page-size", 16, "--num-blocks", 8)
    assert code == 1
    rows = list(read_shards(out))
    assert len(rows) == len(lines)  # every line is answered or recorded, once
    answered = {r["id"] for r in rows if r["error"] is None}
    assert answered == {f"good{i}" for i in range(6)}
    errors = [r["error"] for r in rows if r["error"]]
    assert all(e.startswith(f"{path}:") for e in errors)  # each names its line
    assert next(r["error"] for r in rows if r["id"] == "empty").startswith(f"{path}:8: ")
    for expected in ("invalid JSON", "expected a JSON object", "invalid UTF-8", "empty", "must be a string",
                     "role 'wizard'", "no prompt field", "outside the vocabulary", "does not fit the model's context",
                     "can never fit in the KV cache"):
        assert any(expected in e for e in errors), expected


def test_max_errors_stops_the_job_resumably(tiny_model_dir, tmp_path):
    rows = [{"prompt": "ok"}] + [{"prompt": ""}] * 5 + [{"prompt": f"fine {i}"} for i in range(30)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    args = [path, "-o", out, "--model", tiny_model_dir, "--max-new-tokens", 3, "--max-in-flight", 2]
    assert cbgen(*args, "--max-errors", 2) == 4
    assert json.loads((out / "run.json").read_text())["status"] == "stopped after too many errors"
    assert len({r["id"] for r in read_shards(out)}) < len(rows)
    assert cbgen(*args) == 1  # resumed without the limit: done, with the 5 failures
    assert Counter(r["id"] for r in read_shards(out)) == Counter(str(i) for i in range(len(rows)))


def test_request_timeout_is_recorded(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    out = tmp_path / "out"
    assert cbgen(path, "-o", out, "--model", tiny_model_dir, "--max-new-tokens", 200,
                 "--request-timeout", 0.001) == 1
    rows = list(read_shards(out))
    assert len(rows) == 3
    assert all(r["finish_reason"] == "error" and "timed out after 0.001 s" in r["error"] for r in rows)


@pytest.mark.slow
def test_disk_full_leaves_no_corrupt_shard_and_resumes(tiny_model_dir, prompts, tmp_path, capsys, reference):
    out = tmp_path / "out"
    with disk_full_at_shard(2):  # the disk fills up as the second shard is committed
        assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 2
    assert "disk full while writing" in capsys.readouterr().err
    assert not list(out.glob(".part-*")) and len(list(out.glob("part-*"))) == 1
    assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 0
    assert by_id(out) == reference


@pytest.mark.slow
def test_slurm_array_sharding_and_merge(tiny_model_dir, prompts, tmp_path, monkeypatch, capsys, reference):
    out = tmp_path / "out"
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    for task in (1, 2):  # tasks 1 and 2 of --array=1-3; task 3 has not run yet
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(task))
        assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000-of-00003", "shard-00001-of-00003"]
    assert run_cli(["merge", str(out)]) == 1
    err = capsys.readouterr().err
    assert "shard 2 (it never started):" in err and "ids missing" in err and "nothing was merged" in err
    assert not (out / "merged").exists()
    assert run_cli(["status", str(out)]) == 1

    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert cbgen(*job_args(tiny_model_dir, prompts, out)) == 0
    sizes = [len(list(read_shards(out / f"shard-0000{i}-of-00003"))) for i in range(3)]
    assert all(sizes) and sum(sizes) == len(reference)
    assert run_cli(["merge", str(out)]) == 0
    assert by_id(out / "merged") == reference
    capsys.readouterr()
    assert run_cli(["status", str(out)]) == 0
    assert "complete" in capsys.readouterr().out


def test_explicit_sharding_flags_are_validated(tiny_model_dir, prompts, tmp_path, capsys):
    assert cbgen(*job_args(tiny_model_dir, prompts, tmp_path / "o"), "--num-shards", 2) == 2
    assert "--num-shards 2 needs this job's shard: pass --shard-index" in capsys.readouterr().err
    assert cbgen(*job_args(tiny_model_dir, prompts, tmp_path / "o"), "--num-shards", 2, "--shard-index", 2) == 2
    assert "must be below --num-shards 2" in capsys.readouterr().err
