"""--data-parallel N: replica processes with one reader and one writer. Greedy fp32 and seeded samples equal one
process; a replica killed mid-run has its requests re-run by the others; SIGTERM stops all, resumably."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cbgen.cli import run_cli
from cbgen.engine.replicas import cpu_groups, gpu_groups
from cbgen.errors import CbgenError
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

pytestmark = pytest.mark.slow  # every test starts replica processes


def tokens(out: Path) -> dict[tuple[str, int], list[int]]:
    rows = list(read_shards(out))
    assert len(rows) == len({(r["id"], r["sample_index"]) for r in rows})  # each once
    return {(r["id"], r["sample_index"]): r["token_ids"] for r in rows}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dp")
    return write_jsonl(folder / "p.jsonl", [{"id": f"q{i}", "prompt": f"Tell me about {i} rivers."} for i in range(16)])


@pytest.mark.parametrize("sampling", [[], ["--seed", "3", "--temperature", "0.9", "-n", "2"]])
def test_replicas_write_what_one_process_writes(tiny_model_dir, prompts, tmp_path, sampling):
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--max-new-tokens", "10", "-q", *sampling]
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "one"), *common]) == 0
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "two"), "--data-parallel", "2", *common]) == 0
    assert tokens(tmp_path / "two") == tokens(tmp_path / "one")
    manifest = json.loads((tmp_path / "two" / "run.json").read_text())
    assert manifest["replicas"] == {"count": 2, "lost": {}}


def replica_pids(parent: int) -> list[int]:
    """The replica processes of a cbgen run (spawned children, not multiprocessing's resource tracker)."""
    found = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, found):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "multiprocessing.spawn" in cmdline and "resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


def start(tiny_model_dir, prompts, out, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cbgen", "run", str(prompts), "-o", str(out), "--model", str(tiny_model_dir),
         "--dtype", "float32", "--max-new-tokens", "40", "--data-parallel", "2", "--rows-per-shard", "1",
         "--commit-interval", "0.2", "--max-requests-per-batch", "1", *map(str, extra)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"CBGEN_DEBUG": "1"})


def wait_for_rows(job: subprocess.Popen, out: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not list(out.glob("part-*.jsonl")):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-2000:]
        time.sleep(0.05)


def wait_gone(pids: list[int], timeout: float = 60) -> list[int]:
    """The processes among `pids` still alive once they have all exited, or `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_a_killed_replica_has_its_requests_run_by_the_other(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    job = start(tiny_model_dir, prompts, out)
    wait_for_rows(job, out)
    victims = replica_pids(job.pid)
    assert len(victims) == 2
    os.kill(victims[0], signal.SIGKILL)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert {key for key, _ in tokens(out)} == {f"q{i}" for i in range(16)}
    lost = json.loads((out / "run.json").read_text())["replicas"]["lost"]
    assert len(lost) == 1 and "exited with code -9" in next(iter(lost.values()))


def test_sigterm_stops_every_replica_and_the_job_resumes(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    job = start(tiny_model_dir, prompts, out)
    wait_for_rows(job, out)
    replicas = replica_pids(job.pid)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 75, err[-3000:]
    assert replicas and not wait_gone(replicas)  # every replica stopped
    done_before = len(tokens(out))
    assert 0 < done_before < 16
    rerun = start(tiny_model_dir, prompts, out)
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert {key for key, _ in tokens(out)} == {f"q{i}" for i in range(16)}


def test_cores_and_gpus_are_shared_out():
    assert cpu_groups(2, [0, 1]) == [[0], [1]]
    assert cpu_groups(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    with pytest.raises(CbgenError, match="--data-parallel 3 needs at least 3 CPU cores; this process may use 2"):
        cpu_groups(3, [0, 1])
    assert gpu_groups(2, 2, ["0", "1", "2", "3"]) == [["0", "1"], ["2", "3"]]
    with pytest.raises(CbgenError, match="--data-parallel 3 x --tp 2 needs 6 GPUs; 4 are visible"):
        gpu_groups(3, 2, ["0", "1", "2", "3"])


@pytest.mark.parametrize("visible", ["4,5", "GPU-8f0c1e2a-aaaa-bbbb-cccc-000000000001,GPU-8f0c1e2a-aaaa-bbbb-cccc-2",
                                     "MIG-1d2c3b4a-0000-1111-2222-333333333333, MIG-1d2c3b4a-0000-1111-2222-4444"])
def test_replicas_take_gpus_within_the_parents_visible_ones(visible, monkeypatch):
    """A job started with CUDA_VISIBLE_DEVICES=4,5 (or GPU UUIDs, or MIG instances) gives its replicas those GPUs,
    one each, as names for their own CUDA_VISIBLE_DEVICES: not the machine's GPUs 0 and 1."""
    import torch

    from cbgen.config import JobConfig
    from cbgen.engine.replicas import pool_for

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    job = JobConfig()
    job.run.data_parallel = 2
    pool = pool_for(job, "cuda", plan=None)  # type: ignore[arg-type]
    assert [spec.gpus for spec in pool.specs] == [[name.strip()] for name in visible.split(",")]
    assert all(spec.cpus is None for spec in pool.specs)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [spec.gpus for spec in pool_for(job, "cuda", plan=None).specs] == [["0"], ["1"]]  # type: ignore[arg-type]


def test_replicas_of_a_killed_job_exit_too(tiny_model_dir, prompts, tmp_path):
    job = start(tiny_model_dir, prompts, tmp_path / "out")
    wait_for_rows(job, tmp_path / "out")
    replicas = replica_pids(job.pid)
    job.kill()  # kill -9 of the main process: nobody is left to give the replicas work
    job.communicate(timeout=60)
    assert replicas and not wait_gone(replicas)


def test_the_main_process_loads_no_weights(tiny_model_dir, prompts, tmp_path, monkeypatch):
    """The replicas load the model; the main process reads, renders and plans from its structure (on torch's meta
    device) and its tokenizer only."""
    import cbgen.model.load as load

    asked = []
    real = load.load_model

    def recording(settings, tp=None, *, weights=True):
        asked.append(weights)
        return real(settings, tp, weights=weights)

    monkeypatch.setattr(load, "load_model", recording)
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir), "--dtype",
                    "float32", "--max-new-tokens", "4", "--data-parallel", "2", "-q"]) == 0
    assert asked == [False]
    assert len(tokens(tmp_path / "out")) == 16
