"""The result cache in real runs on the tiny model: a run into a new directory answers from the cache exactly what a
fresh run computes (bf16 and fp32, seeded and greedy), other numerics only when asked, a grown cap recomputes what
its old cap cut, scores, --data-parallel, the Python API, --dry-run, and runs that keep the cache off."""

from __future__ import annotations

import json
import random

import pytest

import cbgen
from cbgen.cli import run_cli
from cbgen.result_cache.store import ResultStore
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

PROMPTS = [f"Tell me about {thing}." for thing in ("rain", "owls", "tea", "salt", "ink", "comets", "bees", "tides")]
SEEDED = ["-t", "0.9", "--seed", "5", "-n", "2"]
GREEDY = ["--batch-invariant"]


def run(model, source, out, *args) -> dict:
    """One `cbgen run`; its run.json."""
    assert run_cli(["run", str(source), "-o", str(out), "--model", str(model), "-q", *map(str, args)]) == 0
    return json.loads((out / "run.json").read_text())


def rows(out) -> dict:
    return {(r["id"], r["sample_index"]): r for r in read_shards(out)}


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])


@pytest.fixture
def shuffled(tmp_path):
    mixed = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    random.Random(3).shuffle(mixed)
    return write_jsonl(tmp_path / "shuffled.jsonl", mixed)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", [SEEDED, GREEDY], ids=["seeded", "greedy"])
def test_hits_are_bitwise_what_a_fresh_run_computes(tiny_model_dir, prompts, shuffled, tmp_path, dtype, mode):
    cache = tmp_path / "cache"
    job = ["--dtype", dtype, "--max-new-tokens", 10, "--logprobs", *mode]
    first = run(tiny_model_dir, prompts, tmp_path / "first", "--cache", cache, *job)
    assert first["result_cache"]["misses"] == len(PROMPTS) and first["result_cache"]["hits"] == 0
    second = run(tiny_model_dir, prompts, tmp_path / "second", "--cache", cache, *job)
    assert second["result_cache"]["hits"] == len(PROMPTS) and second["result_cache"]["misses"] == 0
    assert second["counts"]["result_cache_hits"] == len(PROMPTS)
    # computed afresh in another order and other batches, with no cache: the same bits
    fresh = run(tiny_model_dir, shuffled, tmp_path / "fresh", "--no-cache", "--max-requests-per-batch", 3, *job)
    assert fresh["result_cache"] == {"on": False, "why": "--no-cache (run.result_cache: false)"}
    assert rows(tmp_path / "second") == rows(tmp_path / "fresh") == rows(tmp_path / "first")
    assert all(r["logprobs"] for r in rows(tmp_path / "second").values())


def test_other_numerics_are_computed_afresh_unless_near_hits_are_asked_for(tiny_model_dir, prompts, tmp_path):
    cache, job = tmp_path / "cache", ["--dtype", "float32", "--max-new-tokens", 6, "--no-batch-invariant"]
    run(tiny_model_dir, prompts, tmp_path / "a", "--cache", cache, *job)
    again = run(tiny_model_dir, prompts, tmp_path / "b", "--cache", cache, *job)["result_cache"]
    assert (again["hits"], again["near_hits"], again["misses"]) == (0, 0, len(PROMPTS))
    assert again["near_hits_skipped"] == len(PROMPTS) and not again["exact_hits_possible"]
    near = run(tiny_model_dir, prompts, tmp_path / "c", "--cache", cache, "--cache-near-hits", *job)["result_cache"]
    assert (near["hits"], near["near_hits"], near["misses"]) == (0, len(PROMPTS), 0)
    assert rows(tmp_path / "c") == rows(tmp_path / "b")


def test_a_grown_cap_computes_what_the_old_cap_cut_and_a_smaller_one_cuts(tiny_model_dir, prompts, tmp_path):
    cache = tmp_path / "cache"
    job = ["--dtype", "float32", *SEEDED, "--stop", "e"]  # a stop string ends some sequences within the first cap
    first = run(tiny_model_dir, prompts, tmp_path / "cap3", "--cache", cache, "--max-new-tokens", 3, *job)
    ended = {}
    for (rid, _), row in rows(tmp_path / "cap3").items():
        ended[rid] = ended.get(rid, True) and row["finish_reason"] == "stop"
    assert 0 < sum(ended.values()) < len(PROMPTS), "the test needs requests that ended and requests that were cut"
    assert first["result_cache"]["stored_sequences"] == 2 * len(PROMPTS)
    grown = run(tiny_model_dir, prompts, tmp_path / "cap12", "--cache", cache, "--max-new-tokens", 12, *job)
    assert grown["result_cache"]["hits"] == sum(ended.values())
    assert grown["result_cache"]["misses"] == len(PROMPTS) - sum(ended.values())
    fresh12 = run(tiny_model_dir, prompts, tmp_path / "fresh12", "--no-cache", "--max-new-tokens", 12, *job)
    assert fresh12["result_cache"]["on"] is False
    assert rows(tmp_path / "cap12") == rows(tmp_path / "fresh12")
    small = run(tiny_model_dir, prompts, tmp_path / "cap2", "--cache", cache, "--max-new-tokens", 2, *job)
    assert small["result_cache"]["hits"] == len(PROMPTS)
    run(tiny_model_dir, prompts, tmp_path / "fresh2", "--no-cache", "--max-new-tokens", 2, *job)
    assert rows(tmp_path / "cap2") == rows(tmp_path / "fresh2")


def test_unseeded_sampling_is_never_cached(tiny_model_dir, prompts, tmp_path):
    cache = tmp_path / "cache"
    report = run(tiny_model_dir, prompts, tmp_path / "a", "--cache", cache, "-t", "0.8", "--max-new-tokens", 4)
    assert report["result_cache"]["not_cached"] == len(PROMPTS) and report["result_cache"]["stored_sequences"] == 0
    assert ResultStore(cache).info().entries == 0


def test_scores_hit_exactly_when_scoring_is_batch_invariant(tiny_model_dir, tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", [{"id": f"s{i}", "prompt": p, "completion": " It is lovely."}
                                                for i, p in enumerate(PROMPTS)] + [{"id": "t", "text": "Salt."}])
    cache = tmp_path / "cache"

    def score(out, *args):
        assert run_cli(["score", str(source), "-o", str(tmp_path / out), "--model", str(tiny_model_dir), "-q",
                        "--dtype", "float32", "--logprobs", *args]) == 0
        return json.loads((tmp_path / out / "run.json").read_text())["result_cache"]

    assert score("a", "--cache", str(cache), "--batch-invariant")["misses"] == len(PROMPTS) + 1
    assert score("b", "--cache", str(cache), "--batch-invariant")["hits"] == len(PROMPTS) + 1
    score("fresh", "--no-cache", "--batch-invariant", "--score-batch-tokens", "64")
    by_id = lambda out: {r["id"]: r for r in read_shards(tmp_path / out)}  # noqa: E731
    assert by_id("b") == by_id("fresh") == by_id("a")
    assert score("d", "--cache", str(cache))["hits"] == len(PROMPTS) + 1  # the default: packed rows, invariant too
    shared = score("c", "--cache", str(cache), "--no-batch-invariant")  # padded batches: other numerics
    assert shared["hits"] == 0 and shared["near_hits_skipped"] == len(PROMPTS) + 1


def test_replicas_run_only_what_the_cache_does_not_hold(tiny_model_dir, prompts, tmp_path):
    cache, job = tmp_path / "cache", ["--dtype", "float32", "--max-new-tokens", 6, *SEEDED]
    half = write_jsonl(tmp_path / "half.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS[:4])])
    run(tiny_model_dir, half, tmp_path / "half", "--cache", cache, *job)
    pooled = run(tiny_model_dir, prompts, tmp_path / "pooled", "--cache", cache, "--data-parallel", 2, *job)
    assert (pooled["result_cache"]["hits"], pooled["result_cache"]["misses"]) == (4, 4)
    run(tiny_model_dir, prompts, tmp_path / "fresh", "--no-cache", *job)
    assert rows(tmp_path / "pooled") == rows(tmp_path / "fresh")


def test_the_api_reads_the_cache_it_is_given(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    settings = {"dtype": "float32", "max_new_tokens": 5, "temperature": 0.9, "seed": 1, "cache": str(cache)}
    first = cbgen.generate(PROMPTS[:3], model=str(tiny_model_dir), **settings)
    store = ResultStore(cache)
    assert store.info().entries == 3
    # every entry made to hold tokens no model computed: what the next call returns comes from the cache
    marked = [9, 8, 7, 6, 5]
    for path in store.base.glob("*/*.json"):
        store.put(path.stem, {**store.get(path.stem), "tokens": marked, "finish": "length"})
    second = cbgen.generate(PROMPTS[:3], model=str(tiny_model_dir), **settings)
    assert [r.token_ids for r in second] == [marked] * 3 and [r.token_ids for r in first] != [marked] * 3
    third = cbgen.generate(PROMPTS[:3], model=str(tiny_model_dir), **{**settings, "result_cache": False})
    assert [r.token_ids for r in third] == [r.token_ids for r in first]


def test_dry_run_says_what_the_cache_holds(tiny_model_dir, prompts, tmp_path, capsys):
    cache, job = tmp_path / "cache", ["--dtype", "float32", "--max-new-tokens", 6, *SEEDED]
    half = write_jsonl(tmp_path / "half.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS[:3])])
    run(tiny_model_dir, half, tmp_path / "half", "--cache", cache, *job)
    before = {p: p.stat().st_mtime_ns for p in ResultStore(cache).base.glob("*/*.json")}
    assert run_cli(["run", str(prompts), "--model", str(tiny_model_dir), "--cache", str(cache), "--dry-run", "--json",
                    *map(str, job)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["cached"], report["cached_other_numerics"]) == (3, 0)
    assert {p: p.stat().st_mtime_ns for p in ResultStore(cache).base.glob("*/*.json")} == before  # only looked


def test_the_cache_stays_off_when_told(tiny_model_dir, prompts, tmp_path, monkeypatch):
    job = ["--dtype", "float32", "--max-new-tokens", 4, *SEEDED]
    monkeypatch.setenv("CBGEN_CACHE_DIR", str(tmp_path / "home"))
    report = run(tiny_model_dir, prompts, tmp_path / "a", *job)  # the suite's CBGEN_RESULT_CACHE=off
    assert report["result_cache"] == {"on": False, "why": "CBGEN_RESULT_CACHE=off"}
    monkeypatch.delenv("CBGEN_RESULT_CACHE")
    report = run(tiny_model_dir, prompts, tmp_path / "b", *job)  # on by default, under the user's cache directory
    assert report["result_cache"]["directory"] == str((tmp_path / "home" / "results").resolve())
    assert ResultStore(tmp_path / "home" / "results").info().entries == 2 * len(PROMPTS)
