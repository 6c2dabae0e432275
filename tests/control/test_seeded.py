"""Seeded sampling: a sequence's tokens depend on (seed, input id, sample index, position, the model) alone, so
they are the same in any batch size, input order, resumed run or shard; each sample of a request is its own."""

from __future__ import annotations

import json

import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import disk_full_at_shard, write_jsonl

ROWS = [{"id": f"q{i}", "prompt": f"Tell me about {i}."} for i in range(6)]
SAMPLING = ["--seed", "11", "--temperature", "1.0", "--top-p", "0.95", "-n", "2", "--max-new-tokens", "8"]


def run(tiny_model_dir, path, out, *args) -> int:
    return run_cli(["run", str(path), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "-q",
                    *map(str, args)])


def tokens(out) -> dict[tuple[str, int], list[int]]:
    return {(r["id"], r["sample_index"]): r["token_ids"] for r in read_shards(out)}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("seeded")
    assert run(tiny_model_dir, write_jsonl(folder / "p.jsonl", ROWS), folder / "out", *SAMPLING) == 0
    return tokens(folder / "out")


def test_samples_of_a_request_differ(reference):
    assert len(reference) == 12
    assert all(reference[(f"q{i}", 0)] != reference[(f"q{i}", 1)] for i in range(6))


def test_the_same_in_any_batch_and_order(tiny_model_dir, tmp_path, reference):
    reversed_rows = write_jsonl(tmp_path / "r.jsonl", ROWS[::-1])
    assert run(tiny_model_dir, reversed_rows, tmp_path / "one", *SAMPLING, "--max-requests-per-batch", 1,
               "--max-in-flight", 1) == 0
    assert tokens(tmp_path / "one") == reference


@pytest.mark.slow
def test_the_same_after_a_resume_and_across_shards(tiny_model_dir, tmp_path, reference):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    out = tmp_path / "out"
    with disk_full_at_shard(3):  # the run stops as it commits its third shard: two committed, the rest lost
        assert run(tiny_model_dir, path, out, *SAMPLING, "--rows-per-shard", 2) == 2
    assert len(list(out.glob("part-*.jsonl"))) == 2 and not list(out.glob(".part-*"))
    assert run(tiny_model_dir, path, out, *SAMPLING, "--rows-per-shard", 2) == 0
    assert json.loads((out / "run.json").read_text())["counts"]["resumed_requests"] > 0  # it resumed
    assert tokens(out) == reference  # the resumed samples are those of an uninterrupted run
    split = tmp_path / "split"
    for index in range(2):
        assert run(tiny_model_dir, path, split, *SAMPLING, "--num-shards", 2, "--shard-index", index) == 0
    merged = {}
    for shard in split.glob("shard-*"):
        merged |= tokens(shard)
    assert merged == reference


@pytest.mark.slow
def test_a_rows_own_seed(tiny_model_dir, tmp_path, reference):
    rows = [dict(row, seed=11) for row in ROWS]  # the job's seed, given per row instead
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    assert run(tiny_model_dir, path, tmp_path / "out", *[a for a in SAMPLING if a not in ("--seed", "11")]) == 0
    assert tokens(tmp_path / "out") == reference
    rows[0]["seed"] = 12
    assert run(tiny_model_dir, write_jsonl(tmp_path / "q.jsonl", rows), tmp_path / "other",
               *[a for a in SAMPLING if a not in ("--seed", "11")]) == 0
    other = tokens(tmp_path / "other")
    assert other[("q0", 0)] != reference[("q0", 0)] and other[("q1", 0)] == reference[("q1", 0)]
