"""A pipeline rerun after one stage's template changed for a twelfth of its rows: with the result cache, only those
rows and what descends from them are computed, and the stages end bitwise where a fresh run of the changed pipeline
ends."""

from __future__ import annotations

import json

import yaml

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.pipelines.helpers import write_pipeline

CHANGED = ("{% if persona.age == 20 %}Ask one odd thing about {{ topic }}.{% else %}"
           "Write a question about {{ topic }} for {{ persona.name }}.{% endif %}")  # row 0 only: others as before


def pipeline_file(folder, model, cache, **changes):
    path = write_pipeline(folder, model, **changes)
    spec = yaml.safe_load(path.read_text())
    spec["defaults"] |= {"batch_invariant": True, **({"cache": str(cache)} if cache else {"result_cache": False})}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def counts(out, stage):
    cache = json.loads((out / stage / "run.json").read_text())["result_cache"]
    return cache["hits"], cache["misses"]


def stage_rows(out, stage):
    return {(r["id"], r.get("sample_index", 0)): r for r in read_shards(out / stage)}


def test_only_the_changed_rows_and_their_descendants_are_computed(tiny_model_dir, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    file = pipeline_file(tmp_path, tiny_model_dir, cache)
    assert run_cli(["pipeline", str(file), "-o", str(out), "-q"]) == 0
    assert counts(out, "questions") == (0, 12)
    before = stage_rows(out, "questions")
    pipeline_file(tmp_path, tiny_model_dir, cache, questions={"template": CHANGED})
    assert run_cli(["pipeline", str(file), "-o", str(out), "-q"]) == 0
    after = stage_rows(out, "questions")
    assert counts(out, "questions") == (11, 1)
    changed = [key for key in after if after[key]["text"] != before[key]["text"]]
    assert [key[0] for key in changed] in (["0"], [])
    assert counts(out, "answers") == (12 - len(changed), len(changed))  # a question's two answers: one request
    assert counts(out, "judge") == (24 - 2 * len(changed), 2 * len(changed))
    fresh = tmp_path / "fresh"
    file = pipeline_file(tmp_path, tiny_model_dir, None, questions={"template": CHANGED})
    assert run_cli(["pipeline", str(file), "-o", str(fresh), "-q"]) == 0
    for stage in ("questions", "answers", "judge"):
        assert stage_rows(out, stage) == stage_rows(fresh, stage), stage
