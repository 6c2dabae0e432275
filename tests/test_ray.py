"""--executor ray against a real local Ray cluster started here (`ray start --head` in a temporary directory): a
2-shard job on the tiny model completes and merges, and one whose task's worker process is killed mid-run still
ends with every id exactly once (Ray re-runs the task, which resumes its shard)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cbgen.rows import read_shards
from tests.helpers import write_jsonl

pytestmark = pytest.mark.slow  # a real Ray cluster

# `make install` leaves this marker where it installed Ray: there the Ray tests must run, and a skip is a failure
RAY_INSTALLED = Path(sys.prefix) / "cbgen-ray-installed"
try:
    import ray  # noqa: F401
except ImportError:
    if RAY_INSTALLED.exists():
        raise ImportError(f"make installed Ray ({RAY_INSTALLED} exists) but it does not import") from None
    if os.environ.get("CBGEN_NO_RAY") != "1":
        raise ImportError("Ray is not installed: make test installs it (pip install 'cbgen[ray]'); "
                          "CBGEN_NO_RAY=1 leaves it out on purpose") from None
    pytest.skip("Ray left out on purpose (CBGEN_NO_RAY=1)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Cluster:
    address: str
    temp_dir: Path  # Ray's own files of this cluster: its processes' command lines name it


def cluster_workers(temp_dir: Path, title: str) -> list[int]:
    """The worker processes of this test's own Ray cluster that run `title`: children of the raylet whose command
    line names the cluster's temporary directory (other Ray clusters on the machine are left alone)."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent = int(next(line.split()[1] for line in (entry / "status").read_text().splitlines()
                              if line.startswith("PPid:")))
        except (OSError, StopIteration, ValueError):
            continue
        processes[int(entry.name)] = (command, parent)
    raylets = {pid for pid, (command, _) in processes.items() if "raylet" in command and str(temp_dir) in command}
    return [pid for pid, (command, parent) in processes.items() if title in command and parent in raylets]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    temp = tmp_path_factory.mktemp("ray")
    short = Path(f"/tmp/ray-{os.getpid()}")  # Ray's socket paths must stay short
    port = free_port()
    ray_bin = Path(sys.executable).parent / "ray"
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                    f"--temp-dir={short}", "--include-dashboard=false", "--disable-usage-stats"],
                   check=True, capture_output=True, env=env, timeout=180, cwd=temp)
    yield Cluster(f"127.0.0.1:{port}", short)
    subprocess.run([str(ray_bin), "stop", "--force"], capture_output=True, env=env, timeout=120)
    shutil.rmtree(short, ignore_errors=True)


def cbgen_ray(address, *args, **popen) -> subprocess.Popen:
    env = os.environ | {"RAY_ADDRESS": address, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen([sys.executable, "-m", "cbgen", "run", *map(str, args), "--executor", "ray"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def merged_ids(out: Path) -> list[str]:
    return sorted(r["id"] for r in read_shards(out / "merged"))


def test_the_example_runs_a_two_shard_job_that_merges(cluster, tiny_model_dir, tmp_path):
    """examples/ray.sh as docs/long-jobs.md shows it, on the tiny model."""
    ids = [f"q{i}" for i in range(12)]
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": f"Say {i}."} for i in ids])
    root = Path(__file__).resolve().parents[1]
    env = os.environ | {"RAY_ADDRESS": cluster.address, "RAY_USAGE_STATS_ENABLED": "0", "INPUT": str(path),
                        "OUT": str(tmp_path / "out"), "MODEL": str(tiny_model_dir)}
    env["CBGEN"] = str(Path(sys.executable).parent / "cbgen")
    job = subprocess.Popen(["bash", str(root / "examples" / "ray.sh"), "--max-new-tokens", "4"], env=env, cwd=root,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert merged_ids(tmp_path / "out") == sorted(ids)
    assert "merged 12 rows" in err and "shard 0 done" in err and "shard 1 done" in err
    assert not list((tmp_path / "out").glob(".cbgen-ray-*"))  # the visibility marker is cleaned up


def test_a_killed_worker_is_retried_and_every_id_is_written_once(cluster, tiny_model_dir, tmp_path):
    ids = [f"r{i}" for i in range(48)]
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": f"Tell a long story about {i}."} for i in ids])
    out = tmp_path / "out"
    job = cbgen_ray(cluster.address, path, "-o", out, "--model", tiny_model_dir, "--num-shards", 2,
                    "--max-new-tokens", 48, "--rows-per-shard", 2, "--commit-interval", 0.5,
                    "--max-requests-per-batch", 2)

    def mid_run() -> bool:
        """A shard has committed rows and is still running (run.json is written when a run ends)."""
        return any(list(d.glob("part-*.jsonl")) and not (d / "run.json").exists() for d in out.glob("shard-*"))

    victims: list[int] = []
    deadline = time.time() + 240
    while not victims and time.time() < deadline and job.poll() is None:
        if mid_run():  # kill every running task's worker: the one with committed rows must resume from them
            victims = cluster_workers(cluster.temp_dir, "ray::run_shard")
        time.sleep(0.2)
    assert victims, "no task was seen running"
    for victim in victims:
        os.kill(victim, signal.SIGKILL)
    _, err = job.communicate(timeout=400)
    assert job.returncode == 0, err[-3000:]
    assert merged_ids(out) == sorted(ids)  # each exactly once: merge refuses repeats
    assert "(resumed after " in err  # the killed shard was run again by Ray, and took up where it stopped
