"""examples/pipeline-slurm.sh submits a pipeline as a chain of Slurm jobs. Here `sbatch` is a stand-in that runs
each job at once (an array's tasks one after another, each with the variables Slurm gives it), so the chain runs as
a cluster would run it: every generate and score stage in shards, each sql stage once, in dependency order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cbgen.cli import run_cli
from tests.pipelines.helpers import ids, write_pipeline

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "pipeline-slurm.sh"

FAKE_SBATCH = r'''
import itertools, os, subprocess, sys
args = sys.argv[1:]
wrap = args[args.index("--wrap") + 1]
array = next((a.split("=", 1)[1] for a in args if a.startswith("--array=")), None)
with open(os.environ["SBATCH_LOG"], "a") as log:
    log.write(" ".join(a for a in args if a.startswith(("--array", "--dependency", "--job-name"))) + "\n")
tasks = range(int(array.split("-")[0]), int(array.split("-")[1]) + 1) if array else [None]
for task in tasks:
    env = dict(os.environ)
    if task is not None:
        env |= {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_COUNT": str(len(tasks))}
    done = subprocess.run(["bash", "-c", wrap], env=env)
    if done.returncode not in (0, 1):
        sys.exit(f"task {task} exited {done.returncode}")
print(abs(hash(wrap)) % 100000)
'''


@pytest.mark.slow
def test_the_sbatch_chain_runs_each_stage_in_shards_in_order(tiny_model_dir, tmp_path):
    file = write_pipeline(tmp_path, tiny_model_dir, rows=6)
    out = tmp_path / "out"
    sbatch = tmp_path / "sbatch"
    sbatch.write_text(f"#!{sys.executable}\n{FAKE_SBATCH}")
    sbatch.chmod(0o755)
    log = tmp_path / "sbatch.log"
    env = os.environ | {"SBATCH": str(sbatch), "SBATCH_LOG": str(log), "TASKS": "2",
                        "CBGEN": str(Path(sys.executable).parent / "cbgen")}
    done = subprocess.run(["bash", str(SCRIPT), str(file), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    submitted = log.read_text().splitlines()
    assert [line.split("--job-name=cbgen-")[1].split()[0] for line in submitted] == \
        ["questions", "answers", "judge", "kept"]
    assert "--array=0-1" in submitted[0] and "--array" not in submitted[3]
    assert all("--dependency=afterany:" in line for line in submitted[1:])
    for stage, rows in (("questions", 6), ("answers", 12), ("judge", 12)):
        assert sorted(p.name for p in (out / stage).glob("shard-*")) == ["shard-00000-of-00002",
                                                                           "shard-00001-of-00002"]
        counts = ids(out / stage)
        assert len(counts) == rows and set(counts.values()) == {1}, stage
    assert run_cli(["status", str(out), "--json"]) == 0
    status = json.loads(subprocess.run([env["CBGEN"], "status", str(out), "--json"], capture_output=True,
                                       text=True).stdout)
    assert [s["state"] for s in status["stages"]] == ["complete"] * 4 and status["stages"][3]["rows"] == 6
