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


def test_cbgen_error_is_exported():
    assert cbgen.CbgenError is CbgenError and issubclass(cbgen.RowError, Exception)
    with pytest.raises(cbgen.CbgenError, match="max_new_tokens must be a positive integer"):
        cbgen.generate(["x"], max_new_tokens=0)


def test_the_keyword_types_are_generated_from_the_settings_table():
    """cbgen/api/settings.py is what the settings table gives now (regenerate it with the command its first line
    names), and it has every flat key but `model`, which the functions name themselves."""
    from pathlib import Path

    from cbgen.api.settings import CallSettings, JobSettings, ModelSettings
    from cbgen.config.flat import flat_keys
    from cbgen.config.typed import MODULE, typed_settings_source

    assert (Path(__file__).parent.parent / MODULE).read_text() == typed_settings_source(), \
        "cbgen/api/settings.py is stale: python -m cbgen.config.typed > cbgen/api/settings.py"
    assert set(JobSettings.__annotations__) == set(flat_keys()) - {"model"}
    assert set(ModelSettings.__annotations__) | set(CallSettings.__annotations__) == set(JobSettings.__annotations__)


def test_mypy_checks_the_keywords(tmp_path):
    """What an editor and mypy see: a misspelled keyword or a value of the wrong type is an error."""
    script = tmp_path / "use.py"
    script.write_text("import cbgen\n"
                      "cbgen.generate(['x'], max_new_tokens=8, temperature=0.0, page_size=64)\n"
                      "cbgen.generate(['x'], temprature=0.5)\n"
                      "cbgen.Generator(model='m', dtype='float32').generate(['x'], max_new_tokens='many')\n"
                      "cbgen.run('in.jsonl', 'out', model='m', output_format='parquet')\n")
    config = tmp_path / "mypy.ini"  # cbgen's own modules followed; the heavy libraries behind them left out (speed)
    config.write_text("[mypy]\npython_version = 3.11\nfollow_imports = silent\ncache_dir = " + str(tmp_path / "cache")
                      + "\n[mypy-torch.*,transformers.*,datasets.*,pyarrow.*,numpy.*,huggingface_hub.*,rich.*,typer.*,"
                      "llguidance.*,duckdb.*,jinja2.*,yaml.*,tqdm.*,accelerate.*,gguf.*,safetensors.*]\n"
                      "follow_imports = skip\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), str(script)],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(str(script)) and ": error:" in line]
    assert len(lines) == 2, done.stdout
    assert ":3:" in lines[0] and '"temprature"' in lines[0]
    assert ":4:" in lines[1] and "max_new_tokens" in lines[1]


def test_other_libraries_settings_are_put_back_after_a_call(tiny_model_dir, tmp_path):
    """cbgen quietens transformers' and datasets' logging and bars only while a call runs."""
    import logging

    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_info()
    hf_logging.enable_progress_bar()
    datasets.enable_progress_bars()
    engine_logger = logging.getLogger("ContinuousBatchingLogger")
    engine_logger.setLevel(logging.DEBUG)
    seen = {}
    import cbgen.engine.engine as engine

    real_run = engine.Engine.run

    def run(self, *args, **kwargs):
        seen["verbosity"] = hf_logging.get_verbosity()
        seen["bar"] = hf_logging.is_progress_bar_enabled()
        seen["engine"] = engine_logger.level
        yield from real_run(self, *args, **kwargs)

    engine.Engine.run = run
    try:
        path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi."}])
        cbgen.run(path, tmp_path / "out", model=str(tiny_model_dir), max_new_tokens=2)
        cbgen.load(tmp_path / "out")
    finally:
        engine.Engine.run = real_run
    assert seen == {"verbosity": logging.INFO, "bar": True, "engine": logging.DEBUG}  # entered before the scope
    assert hf_logging.get_verbosity() == logging.INFO and hf_logging.is_progress_bar_enabled()
    assert engine_logger.level == logging.DEBUG and datasets.is_progress_bar_enabled()
    hf_logging.set_verbosity_warning()


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
    stopped = [r for r in json_answers if r.finish_reason == "stop"]
    assert stopped, "no JSON answer ended within 30 tokens: nothing below would be checked"
    assert all(r.parsed == json.loads(r.text) for r in stopped)
    assert all(r.parsed is None for r in json_answers if r.finish_reason == "length")
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
