"""Every flag `cbgen pipeline` takes reaches its stages: each stage's job carries it, and the result-cache flags show
in each stage's run.json (a rerun with --no-cache computes; --cache DIR is where its results go)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cbgen.cli import run_cli
from cbgen.cli.pipeline_cmd import PIPELINE_OPTIONS
from tests.helpers import write_jsonl

STAGES = ("answers", "judge")
# a value for each flag unlike its default (num_shards and shard_index split one stage: tested with --stage)
VALUES = {"result_cache": False, "cache": "/tmp/somewhere", "cache_max_size": 3.0, "cache_near_hits": True,
          "redo": ["failed"]}


def write_two_stages(folder: Path, model: Path) -> Path:
    write_jsonl(folder / "seed.jsonl", [{"id": f"r{i}", "prompt": f"Say {i}."} for i in range(4)])
    stages = [{"name": "answers", "kind": "generate", "input": "seed.jsonl", "max_new_tokens": 4},
              {"name": "judge", "kind": "score", "input": "answers", "choices": ["1", "2"],
               "template": "{{ answers.text }} Score:"}]
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"defaults": {"model": str(model), "dtype": "float32"}, "stages": stages}))
    return path


def stage_cache(out: Path, stage: str) -> dict:
    return json.loads((out / stage / "run.json").read_text())["result_cache"]


def test_every_pipeline_flag_reaches_every_stage_job(tiny_model_dir, tmp_path):
    from cbgen.pipelines import load_pipeline
    from cbgen.pipelines.checks import plan_pipeline
    from cbgen.pipelines.runner import PipelineRun

    spec = load_pipeline(str(write_two_stages(tmp_path, tiny_model_dir)))
    for option in PIPELINE_OPTIONS:
        if option.key in ("num_shards", "shard_index"):
            continue
        (tmp_path / "out" / "answers").mkdir(parents=True, exist_ok=True)
        (tmp_path / "out" / "answers" / "fingerprint.json").write_text("{}")  # a redo needs an earlier run
        (tmp_path / "out" / "judge").mkdir(parents=True, exist_ok=True)
        (tmp_path / "out" / "judge" / "fingerprint.json").write_text("{}")
        value = VALUES[option.key]
        run = PipelineRun(spec, tmp_path / "out", extra={(option.section, option.key): (value, option.key)})
        run.plans = plan_pipeline(spec, tmp_path / "out")
        for stage in spec.stages:  # each stage is handed the flag (the judge's job needs the answers' table)
            assert (option.section, option.key) in run._overrides(stage), f"{option.flags[0]} not for {stage.name}"
        job = run.job_of("answers")[0]  # and its job carries it
        got = getattr(getattr(job, option.section), option.key)
        if option.key == "redo":
            assert got, "--redo did not reach the answers' job"
        else:
            assert got == value or str(got) == str(value), f"{option.flags[0]} did not reach the answers' job: {got}"


def test_no_cache_and_cache_dir_show_in_each_stage_run_json(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("CBGEN_RESULT_CACHE", raising=False)  # the suite turns the cache off; these runs use one
    file = write_two_stages(tmp_path, tiny_model_dir)
    store = tmp_path / "results"
    assert run_cli(["pipeline", str(file), "-o", str(tmp_path / "first"), "-q", "--cache", str(store)]) == 0
    for stage in STAGES:
        cache = stage_cache(tmp_path / "first", stage)
        assert cache["on"] and Path(cache["directory"]) == store.resolve()
    assert run_cli(["pipeline", str(file), "-o", str(tmp_path / "again"), "-q", "--cache", str(store),
                    "--no-cache"]) == 0
    for stage in STAGES:
        assert stage_cache(tmp_path / "again", stage) == {"on": False, "why": "--no-cache (run.result_cache: false)"}


@pytest.mark.parametrize("flag", ["--num-shards", "--shard-index"])
def test_splitting_flags_ask_for_a_stage(tiny_model_dir, tmp_path, capsys, flag):
    file = write_two_stages(tmp_path, tiny_model_dir)
    assert run_cli(["pipeline", str(file), "-o", str(tmp_path / "out"), flag, "1"]) == 2
    assert "--stage NAME" in capsys.readouterr().err


# names several kinds' own sections share, each with a value unlike every section's default
SHARED = {"batch_tokens": 77, "text_column": "body"}


@pytest.mark.parametrize("kind", ["score", "embed", "reward"])
@pytest.mark.parametrize("where", ["stage", "defaults"])
def test_a_name_kinds_share_is_the_stage_kinds_own_setting(tiny_model_dir, tmp_path, kind, where):
    """`batch_tokens` or `text_column` on a score stage sets the score section's, on an embed stage the embed
    section's (each kind's own section has them)."""
    from cbgen.pipelines import load_pipeline
    from cbgen.pipelines.checks import stage_job

    stage = {"name": "s", "kind": kind, "input": "seed.jsonl", "model": str(tiny_model_dir),
             **({"choices": ["1", "2"]} if kind == "score" else {})}
    stage |= SHARED if where == "stage" else {}
    data = {"stages": [stage], **({"defaults": SHARED} if where == "defaults" else {})}
    spec = load_pipeline(data)
    job = stage_job(spec, spec.stages[0], str(tmp_path / "seed.jsonl"), tmp_path / "out", ())
    for key, value in SHARED.items():
        assert getattr(getattr(job, kind), key) == value, f"{key} did not reach the {kind} section"


def test_the_embedder_takes_its_own_batch_tokens(tmp_path):
    import cbgen
    from tests.encoders.test_embed import bert_folder

    embedder = cbgen.Embedder(str(bert_folder(tmp_path, "mean", True)), dtype="float32", batch_tokens=77)
    assert embedder._job.embed.batch_tokens == 77
