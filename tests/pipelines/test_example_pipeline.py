"""examples/synth/pipeline.yaml on the embedded model, as the README runs it: killed with -9 in the middle of its
answers stage, run again, and finished with every row of every stage once and each question at most once in the
final dataset, which loads with `datasets` and has its card."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import yaml
from huggingface_hub import DatasetCard

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from cbgen.rows.rundir import MANIFEST_FILE

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "synth"

pytestmark = [pytest.mark.embedded, pytest.mark.slow]


def test_the_example_pipeline_killed_and_resumed_keeps_each_row_once(tmp_path):
    folder = tmp_path / "synth"
    shutil.copytree(EXAMPLE, folder)
    file = folder / "pipeline.yaml"
    data = yaml.safe_load(file.read_text())
    data["defaults"]["rows_per_shard"] = 4  # committed a few rows at a time, so that a kill lands between commits
    file.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "cbgen", "pipeline", str(file), "-o", str(out), "-q"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    answers = out / "answers"
    deadline = time.monotonic() + 300
    while not list(answers.glob("part-*.parquet")):
        assert process.poll() is None and time.monotonic() < deadline, "the answers stage never committed rows"
        time.sleep(0.01)
    process.kill()
    process.wait()
    assert not (answers / MANIFEST_FILE).exists() or '"complete"' not in (answers / MANIFEST_FILE).read_text()
    assert run_cli(["pipeline", str(file), "-o", str(out), "-q"]) == 0
    seeds = pq.read_table(folder / "seed.parquet").column("id").to_pylist()
    for stage, expected in (("questions", seeds), ("answers", [f"{s}/{k}" for s in seeds for k in (0, 1)]),
                            ("judge", [f"{s}-{k}" for s in seeds for k in (0, 1)])):
        found = Counter(f"{r['id']}/{r['sample_index']}" if stage == "answers" else r["id"]
                        for r in read_shards(out / stage))
        assert sorted(found) == sorted(expected) and set(found.values()) == {1}, stage
    best = datasets.load_dataset(str(out / "best"), split="train")
    assert len(set(best["question_id"])) == len(best) and set(best["question_id"]) <= set(seeds)
    judged = [r for r in read_shards(out / "judge") if r["questions"]["parsed"] is not None]
    average = sum(sum(p * (i + 1) for i, p in enumerate(r["choice_probs"])) for r in judged) / len(judged)
    assert 0 < len(best) < len(judged)  # the judge's filter kept some answers and dropped others
    assert all(score >= average - 1e-9 for score in best["expected_score"])
    assert DatasetCard.load(out / "best" / "README.md").data["cbgen"]["reads"] == ["judge"]
