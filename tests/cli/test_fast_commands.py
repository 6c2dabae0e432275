"""Commands that load no model answer at once: they never import torch or transformers (each costs seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import write_jsonl

HEAVY = ("torch", "transformers", "datasets")

# Runs the CLI in a fresh interpreter and reports its exit code and which heavy libraries it imported
PROBE = f"""
import json, sys
from cbgen.cli import run_cli
code = run_cli(sys.argv[1:])
print(json.dumps({{"code": int(code), "imported": [m for m in {HEAVY!r} if m in sys.modules]}}), file=sys.stderr)
"""


def cli(*args) -> tuple[int, list[str], str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, timeout=60)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return report["code"], report["imported"], done.stdout


def split_job(tmp_path: Path) -> Path:
    """The output directory of a job split in two, written with cbgen's own run-directory and writer code (what a
    Slurm array of two tasks leaves), so the commands below have something real to read."""
    from cbgen.config import JobConfig
    from cbgen.parallel.sharding import shard_directory, shard_of
    from cbgen.rows.rundir import RunDirectory
    from cbgen.rows.writers import JsonlShardWriter

    ids = [f"q{i}" for i in range(6)]
    job = JobConfig()
    job.input.path = str(write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": f"say {i}"} for i in ids]))
    base = tmp_path / "out"
    for index in range(2):
        directory = shard_directory(base, (index, 2))
        opened = RunDirectory(directory).open({"model": "m", "shard": [index, 2]}, job.to_dict(),
                                              {"column": "id", "chosen_by": "the rows' own id field"})
        with opened, JsonlShardWriter(directory) as writer:
            for request_id in ids:
                if shard_of(request_id, 2) == index:
                    writer.write({"id": request_id, "sample_index": 0, "text": "hi", "token_ids": [1],
                                  "num_prompt_tokens": 3, "num_generated_tokens": 1, "finish_reason": "stop",
                                  "error": None})
    return base


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["status", "--help"], ["config", "show",
                                                                                        "--page-size", "64"]])
def test_help_and_config_show(args):
    code, imported, out = cli(*args)
    assert code == 0 and imported == []
    assert out.strip()


def test_config_init(tmp_path):
    code, imported, _ = cli("config", "init", tmp_path / "job.yaml")
    assert code == 0 and imported == [] and (tmp_path / "job.yaml").read_text().startswith("# cbgen job file")


def test_status_and_merge(tmp_path):
    base = split_job(tmp_path)
    code, imported, out = cli("status", base, "--json")
    assert (code, imported) == (0, [])
    report = json.loads(out)
    assert report["complete"] and report["done"] == 6 and report["remaining"] == 0
    assert [d["state"] for d in report["directories"]] == ["complete", "complete"]
    code, imported, out = cli("status", base)
    assert (code, imported) == (0, []) and "complete" in out
    code, imported, out = cli("merge", base, "-o", tmp_path / "merged", "--json")
    assert (code, imported) == (0, [])
    assert json.loads(out) == {"merged": True, "output": str(tmp_path / "merged"), "rows": 6, "missing": {},
                               "duplicated": [], "unexpected": [], "shards_not_started": []}


def test_status_and_merge_json_when_a_shard_is_missing(tmp_path):
    base = split_job(tmp_path)
    lost = sorted(base.glob("shard-00001-of-00002/part-*.jsonl"))
    lost_ids = [json.loads(line)["id"] for path in lost for line in path.read_text().splitlines()]
    for path in lost:
        path.unlink()
    code, _, out = cli("status", base, "--json")
    report = json.loads(out)
    assert code == 1 and not report["complete"] and report["remaining"] == len(lost_ids)
    assert report["directories"][1]["state"] == "incomplete"
    code, _, out = cli("merge", base, "--json")
    assert code == 1
    assert json.loads(out)["missing"] == {"1": lost_ids} and not (base / "merged").exists()
