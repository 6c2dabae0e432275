"""Structured outputs end to end on the tiny random model: whatever it would have said, every output that ends
with finish_reason 'stop' follows its format, and one that ran out of tokens says 'length'."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import disk_full_at_shard, write_jsonl

# a record the random model can finish in a few tokens (bounded values, compact JSON)
RECORD = {"type": "object", "additionalProperties": False, "required": ["age", "ok", "color"],
          "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]}}}
OTHER = {"type": "object", "additionalProperties": False, "required": ["n"],
         "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 12}}}


def run(tiny_model_dir, path, out, *args) -> int:
    return run_cli(["run", str(path), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "-q",
                    *map(str, args)])


def rows(out) -> dict[str, dict]:
    return {r["id"]: r for r in read_shards(out)}


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Describe person {i}."} for i in range(6)])


def test_job_schema_outputs_parse_and_validate(tiny_model_dir, prompts, tmp_path):
    schema = tmp_path / "record.json"
    schema.write_text(json.dumps(RECORD))
    assert run(tiny_model_dir, prompts, tmp_path / "out", "--json-schema", schema, "--max-new-tokens", 40) == 0
    written = rows(tmp_path / "out")
    assert len(written) == 6
    for row in written.values():
        assert row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["text"]), RECORD)
        assert list(json.loads(row["text"])) == ["age", "ok", "color"]  # in the schema's order, not sorted
    manifest = json.loads((tmp_path / "out" / "run.json").read_text())
    assert manifest["step_control"]["formats_compiled"] == 1


def test_an_output_that_runs_out_of_tokens_is_never_presented_as_complete(tiny_model_dir, prompts, tmp_path):
    assert run(tiny_model_dir, prompts, tmp_path / "out", "--json-schema", json.dumps(RECORD),
               "--max-new-tokens", 4) == 0
    for row in rows(tmp_path / "out").values():
        assert row["finish_reason"] == "length" and row["num_generated_tokens"] == 4
        with pytest.raises(json.JSONDecodeError):
            json.loads(row["text"])


@pytest.mark.parametrize(("flags", "check"), [
    (["--regex", "[0-9]{3}-[0-9]{4}"], lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
    (["--choice", "yes", "--choice", "no", "--choice", "maybe not"], lambda text: text in ("yes", "no", "maybe not")),
])
def test_regex_and_choice(tiny_model_dir, prompts, tmp_path, flags, check):
    assert run(tiny_model_dir, prompts, tmp_path / "out", *flags, "--max-new-tokens", 60) == 0
    written = rows(tmp_path / "out").values()
    assert written and all(row["finish_reason"] == "stop" and check(row["text"]) for row in written), written


def test_an_object_is_an_object_while_it_is_written(tiny_model_dir, prompts, tmp_path):
    """--json-object on the tiny random model: its strings run on to the token cap (an ended object is checked on
    the embedded model, tests/outputs/test_parsed.py); what it writes is still the start of a JSON object."""
    assert run(tiny_model_dir, prompts, tmp_path / "out", "--json-object", "--max-new-tokens", 12) == 0
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    # every token written is one a JSON object's grammar, built here by llguidance itself, takes at that point
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    info = llguidance.hf.from_tokenizer(tokenizer)
    grammar = LLMatcher.grammar_from_json_schema({"type": "object"})
    for row in rows(tmp_path / "out").values():
        assert row["text"].lstrip().startswith("{"), row
        matcher = LLMatcher(info, grammar, log_level=0)
        tokens = [t for t in row["token_ids"] if t != tokenizer.eos_token_id]
        assert matcher.try_consume_tokens(tokens) == len(tokens) and not matcher.is_error(), row
        if row["finish_reason"] == "stop":
            assert isinstance(json.loads(row["text"]), dict) and matcher.is_accepting()


@pytest.mark.parametrize(("name", "text"), [
    ("g.lark", 'start: "SKU-" DIGIT DIGIT ("A" | "B")\nDIGIT: /[0-9]/\n'),
    ("g.gbnf", 'root ::= "SKU-" digit digit ("A" | "B")\ndigit ::= [0-9]\n'),  # llama.cpp's dialect, read too
])
def test_a_grammar_file(tiny_model_dir, prompts, tmp_path, name, text):
    grammar = tmp_path / name
    grammar.write_text(text)
    assert run(tiny_model_dir, prompts, tmp_path / "out", "--grammar", grammar, "--max-new-tokens", 20) == 0
    for row in rows(tmp_path / "out").values():
        assert row["finish_reason"] == "stop" and re.fullmatch(r"SKU-[0-9]{2}[AB]", row["text"]), row


@pytest.mark.slow
def test_rows_carry_their_own_formats_and_bad_ones_are_error_records(tiny_model_dir, tmp_path):
    schema_a = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
    data = [
        {"id": "a", "prompt": "one", "response_format": schema_a},
        {"id": "b", "prompt": "two", "response_format": {"type": "json_schema", "json_schema": {"schema": OTHER}}},
        {"id": "c", "prompt": "three", "response_format": {"type": "choice", "choices": ["left", "right"]},
         "temperature": 1.5, "seed": 3},  # per-row sampling, under a format
        {"id": "d", "prompt": "four", "response_format": {"type": "text"}},
        {"id": "e", "prompt": "five"},
        {"id": "bad-schema", "prompt": "six", "response_format": {"type": "json_schema",
                                                                   "json_schema": {"schema": {"type": "objec"}}}},
        {"id": "bad-type", "prompt": "seven", "response_format": {"type": "xml"}},
        {"id": "bad-regex", "prompt": "eight", "response_format": {"type": "regex", "pattern": "[0-9]{3"}},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", data)
    assert run(tiny_model_dir, path, tmp_path / "out", "--max-new-tokens", 40) == 1
    written = rows(tmp_path / "out")
    jsonschema.validate(json.loads(written["a"]["text"]), RECORD)
    jsonschema.validate(json.loads(written["b"]["text"]), OTHER)
    assert written["c"]["text"] in ("left", "right")
    assert all(written[k]["error"] is None for k in "abcde")
    assert "a JSON schema cannot be compiled: Invalid type: objec" in written["bad-schema"]["error"]
    assert "response_format.type must be one of" in written["bad-type"]["error"]
    assert "a regular expression cannot be compiled" in written["bad-regex"]["error"]
    assert all(written[k]["error"].startswith(f"{path}:") for k in ("bad-schema", "bad-type", "bad-regex"))


@pytest.mark.slow
def test_several_samples_each_follow_the_format(tiny_model_dir, prompts, tmp_path):
    assert run(tiny_model_dir, prompts, tmp_path / "out", "--json-schema", json.dumps(RECORD), "-n", 3,
               "--temperature", 1.0, "--seed", 1, "--max-new-tokens", 40) == 0
    written = list(read_shards(tmp_path / "out"))
    assert len(written) == 18
    for row in written:
        assert row["finish_reason"] == "stop"
        jsonschema.validate(json.loads(row["text"]), RECORD)
    assert len({r["text"] for r in written}) > 6  # the samples differ


def test_a_stop_string_that_cuts_a_format_short_is_an_honest_error(tiny_model_dir, prompts, tmp_path):
    assert run(tiny_model_dir, prompts, tmp_path / "out", "--choice", "hello world", "--stop", "world",
               "--max-new-tokens", 10) == 1
    for row in rows(tmp_path / "out").values():
        assert row["finish_reason"] == "error"
        assert "a stop string ended the sequence before its response_format was complete" in row["error"]


@pytest.mark.slow
def test_a_constrained_job_resumes(tiny_model_dir, prompts, tmp_path):
    args = ["--json-schema", json.dumps(RECORD), "--max-new-tokens", 40, "--rows-per-shard", 1]
    assert run(tiny_model_dir, prompts, tmp_path / "whole", *args) == 0
    first = rows(tmp_path / "whole")  # an uninterrupted run
    out = tmp_path / "out"
    with disk_full_at_shard(4):  # the run stops as it commits its fourth shard: three committed, the rest lost
        assert run(tiny_model_dir, prompts, out, *args) == 2
    assert len(list(out.glob("part-*.jsonl"))) == 3 and not list(out.glob(".part-*"))
    assert run(tiny_model_dir, prompts, out, *args) == 0
    assert json.loads((out / "run.json").read_text())["counts"]["resumed_requests"] > 0  # it resumed
    again = rows(out)
    assert sorted(again) == sorted(first) and len(list(read_shards(out))) == 6
    assert again == first  # greedy: the resumed run's rows are what the uninterrupted run wrote


@pytest.mark.slow
def test_many_distinct_schemas_compile_once_each(tiny_model_dir, tmp_path):
    data = []
    for i in range(100):
        schema = {"type": "object", "additionalProperties": False, "required": [f"field_{i}"],
                  "properties": {f"field_{i}": {"type": "boolean"}}}
        for copy in range(2):  # each schema twice: still compiled once
            data.append({"id": f"r{i}-{copy}", "prompt": "x", "response_format": {
                "type": "json_schema", "json_schema": {"schema": schema}}})
    path = write_jsonl(tmp_path / "p.jsonl", data)
    assert run(tiny_model_dir, path, tmp_path / "out", "--max-new-tokens", 20) == 0
    for row in read_shards(tmp_path / "out"):
        value = json.loads(row["text"])
        assert row["finish_reason"] == "stop" and list(value) == [f"field_{row['id'].split('-')[0][1:]}"]
    control = json.loads((tmp_path / "out" / "run.json").read_text())["step_control"]
    assert control["formats_compiled"] == 100 and control["compile_s"] > 0  # each once, and its time recorded


def test_openai_lines_with_a_json_schema(tiny_model_dir, tmp_path):
    from openai.types.chat import ChatCompletion

    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "A person, please."}], "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": RECORD,
                                                                   "strict": True}}}}
    path = write_jsonl(tmp_path / "batch.jsonl", [line])
    assert run(tiny_model_dir, path, tmp_path / "out", "--output-format", "openai") == 0
    body = json.loads(next((tmp_path / "out").glob("part-*.jsonl")).read_text())["response"]["body"]
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), RECORD)
