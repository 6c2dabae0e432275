"""Temperature 0 is greedy decoding wherever a temperature is given, as in OpenAI's API and vLLM: the flag, a job
YAML, a pipeline stage, the Python API, a row's own setting and an OpenAI batch line all give the greedy tokens."""

from __future__ import annotations

import json

import pytest
import yaml

import cbgen
from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

PROMPTS = ["Name a river.", "Count to three.", "What is rain?"]


def _tokens(rows) -> dict[str, list[int]]:
    return {str(row["id"] if isinstance(row, dict) else row.id): (row["token_ids"] if isinstance(row, dict)
                                                                  else row.token_ids) for row in rows}


@pytest.fixture(scope="module")
def greedy(tiny_model_dir) -> dict[str, list[int]]:
    """The greedy tokens of each prompt (the default: no sampling setting at all)."""
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)]
    return _tokens(cbgen.generate(rows, model=str(tiny_model_dir), dtype="float32", max_new_tokens=6,
                                  progress=False))


def _run(tiny_model_dir, tmp_path, name, rows, *extra) -> tuple[dict, dict]:
    source = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / name
    assert run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "--max-new-tokens", "6", "-q", *map(str, extra)]) == 0
    manifest = json.loads((out / "run.json").read_text())
    manifest["fingerprint"] = json.loads((out / "fingerprint.json").read_text())["fingerprint"]
    return _tokens(read_shards(out)), manifest


def test_the_flag_a_yaml_file_and_the_python_api(greedy, tiny_model_dir, tmp_path):
    """Each job also gives a sampling setting (top-k, top-p, a seed), which alone makes a job sample: temperature 0
    still makes it greedy. The control: the same job without it samples other tokens."""
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)]
    sampled, manifest = _run(tiny_model_dir, tmp_path, "sampled", rows, "--top-k", 50, "--seed", 3)
    assert manifest["fingerprint"]["generation"]["do_sample"] is True and sampled != greedy
    flag, manifest = _run(tiny_model_dir, tmp_path, "flag", rows, "--temperature", 0, "--top-k", 50, "--seed", 3)
    assert flag == greedy and manifest["config"]["generation"]["temperature"] == 0
    assert manifest["fingerprint"]["generation"]["do_sample"] is False
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"generation": {"temperature": 0, "top_p": 0.5}}))  # top_p ignored, as vLLM does
    assert _run(tiny_model_dir, tmp_path, "yaml", rows, "--config", config)[0] == greedy
    api = cbgen.generate(rows, model=str(tiny_model_dir), dtype="float32", max_new_tokens=6, temperature=0,
                         top_k=50, seed=3, progress=False)
    assert _tokens(api) == greedy


def test_a_row_and_an_openai_line_in_a_sampled_job(greedy, tiny_model_dir, tmp_path):
    rows = [{"id": str(i), "prompt": p, **({"temperature": 0} if i != 1 else {})} for i, p in enumerate(PROMPTS)]
    sampled, _ = _run(tiny_model_dir, tmp_path, "rows", rows, "--temperature", 1.5, "--seed", 3)
    assert sampled["0"] == greedy["0"] and sampled["2"] == greedy["2"]
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 6}}
             for i, p in enumerate(PROMPTS)]
    source = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "openai"
    assert run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "-q",
                    "--temperature", "1", "--seed", "3"]) == 0
    assert _tokens(read_shards(out)) == greedy


def test_a_pipeline_stage(greedy, tiny_model_dir, tmp_path):
    (tmp_path / "seed.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                                                 for i, p in enumerate(PROMPTS)))
    data = {"defaults": {"model": str(tiny_model_dir), "dtype": "float32"},
            "stages": [{"name": "answers", "kind": "generate", "input": "seed.jsonl", "temperature": 0,
                        "top_p": 0.9, "seed": 3, "max_new_tokens": 6}]}
    file = tmp_path / "pipeline.yaml"
    file.write_text(yaml.safe_dump(data))
    assert run_cli(["pipeline", str(file), "-o", str(tmp_path / "out"), "-q"]) == 0
    assert _tokens(read_shards(tmp_path / "out" / "answers")) == greedy
