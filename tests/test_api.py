"""The Python API, in process on the tiny model: generate() and a Generator reused across calls give results in
input order with the settings' effects; keywords are the YAML keys, checked as flags are; run() is `cbgen run`;
load() reads the folder back; importing cbgen imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import cbgen
from cbgen.errors import CbgenError
from tests.helpers import write_jsonl

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def test_importing_cbgen_imports_no_torch():
    code = "import sys, cbgen; cbgen.generate; cbgen.Generator; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_generate_every_kind_of_prompt_in_input_order(tiny_model_dir):
    prompts = ["Hi there.", [{"role": "user", "content": "Count to three."}], {"prompt": "A row.", "max_new_tokens": 2},
               "Last one, and a longer one at that, to finish later than the others maybe."]
    results = cbgen.generate(prompts, model=str(tiny_model_dir), max_new_tokens=6, dtype="float32", logprobs=True)
    assert [r.id for r in results] == ["0", "1", "2", "3"]
    assert len(results[2].token_ids) <= 2 and all(len(r.token_ids) <= 6 for r in results)
    assert all(r.text is not None and len(r.logprobs) == len(r.token_ids) for r in results)


def test_a_generator_loads_once_and_takes_new_settings_each_call(tiny_model_dir, monkeypatch):
    import cbgen.model.load as load

    loads = []
    real = load.load_model
    monkeypatch.setattr(load, "load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    rows = [{"id": f"t{i}", "topic": topic} for i, topic in enumerate(["rivers", "stars", "moss"])]
    with cbgen.Generator(model=str(tiny_model_dir), dtype="float32") as generator:
        first = generator.generate(rows, template="One question about {{ topic }}.", max_new_tokens=4)
        json_answers = generator.generate(rows, template="{{ topic }}: yes or no?", json_schema=json.dumps(SCHEMA),
                                          max_new_tokens=30)
        sampled = generator.generate(["Once upon a time"], temperature=1.0, seed=3, num_return_sequences=3,
                                     max_new_tokens=5)
    assert loads == [1]  # one load for three calls
    assert [r.id for r in first] == ["t0", "t1", "t2"] and all(len(r.token_ids) == 4 for r in first)
    assert all(r.parsed == json.loads(r.text) for r in json_answers if r.finish_reason == "stop")
    assert [r.sample_index for r in sampled] == [0, 1, 2] and len({tuple(r.token_ids) for r in sampled}) > 1
    assert generator._loaded is None  # closed


def test_keywords_are_checked_as_flags_are(tiny_model_dir):
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_token'; did you mean 'max_new_tokens'"):
        cbgen.generate(["x"], model=str(tiny_model_dir), max_new_token=3)
    with pytest.raises(CbgenError, match="max_new_tokens must be a positive integer"):
        cbgen.generate(["x"], model=str(tiny_model_dir), max_new_tokens=0)
    generator = cbgen.Generator(model=str(tiny_model_dir))
    with pytest.raises(TypeError, match="'dtype' here: it is a model setting"):
        generator.generate(["x"], dtype="float32")


def test_run_and_load(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"Say {i}."} for i in range(5)])
    summary = cbgen.run(path, tmp_path / "out", model=str(tiny_model_dir), max_new_tokens=3, output_format="parquet")
    assert summary.succeeded == 5 and summary.exit_code == 0
    rows = cbgen.load(tmp_path / "out")
    assert rows["id"] == [f"r{i}" for i in range(5)] and set(rows.column_names) >= {"text", "token_ids"}
    again = cbgen.run(path, tmp_path / "out", model=str(tiny_model_dir), max_new_tokens=3, output_format="parquet")
    assert again.resumed_requests == 5  # resumable, as the command is


def test_progress_shows_where_someone_looks(monkeypatch, capsys):
    from cbgen.api import _progress
    from cbgen.progress import BarProgress, NullProgress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert isinstance(_progress(None), NullProgress)  # a script, a cron job: quiet
    assert isinstance(_progress(False), NullProgress)
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # a notebook's kernel is running
    assert isinstance(_progress(None), BarProgress)
    bar = _progress(True)
    bar.start(4)
    bar.advance(4, 10, 12, 0)
    bar.finish()
    assert "4/4" in capsys.readouterr().err
