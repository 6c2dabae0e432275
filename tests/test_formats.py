"""Reading output formats: OpenAI's response_format shapes, cbgen's own, the job's flags; bad ones say why."""

from __future__ import annotations

import json

import pytest

from cbgen.chat.formats import FormatError, ResponseFormat, job_format, parse_response_format
from cbgen.cli import run_cli
from cbgen.config import GenerationSection
from tests.helpers import write_jsonl

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_openai_shapes():
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == ResponseFormat("json_object", "{}")
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                                       "strict": True}})
    assert (fmt.kind, fmt.name, fmt.schema) == ("json_schema", "thing", SCHEMA)
    # the same schema written with other spacing is one format (compiled once); the key order is part of it,
    # since properties are generated in the schema's order
    spaced = json.dumps(SCHEMA, indent=4)
    assert parse_response_format({"type": "json_schema", "json_schema": {"schema": spaced}}).key == fmt.key
    shuffled = {"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"}
    assert parse_response_format({"type": "json_schema", "json_schema": {"schema": shuffled}}).key != fmt.key
    assert parse_response_format(json.dumps({"type": "regex", "pattern": "a+"})) == ResponseFormat("regex", "a+")
    assert parse_response_format({"type": "choice", "choices": ["y", "n", "y"]}).spec == '["y", "n"]'
    assert ResponseFormat.from_key(fmt.key) == ResponseFormat(fmt.kind, fmt.spec)


@pytest.mark.parametrize(("value", "message"), [
    ({"type": "yaml"}, "response_format.type must be one of text, json_object, json_schema, regex, choice, grammar"),
    ({"type": "json_schema"}, "'response_format.json_schema' must be an object with 'name' and 'schema'"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "'response_format.json_schema.schema' must be a JSON "
                                                              "schema (an object), got a list"),
    ({"type": "regex", "pattern": "(a"}, "'response_format.pattern' is not a valid regular expression"),
    ({"type": "choice", "choices": []}, "'response_format.choices' must be a non-empty list of non-empty strings"),
    ({"type": "grammar"}, "'response_format.grammar' must be a grammar text"),
    (5, "'response_format' must be an object such as"),
    ("{not json", "'response_format' is not valid JSON"),
])
def test_bad_formats_say_what_is_wrong(value, message):
    with pytest.raises(FormatError) as e:
        parse_response_format(value)
    assert message in str(e.value)


def test_job_flags(tmp_path):
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert job_format(GenerationSection(json_schema=str(schema_file))).schema == SCHEMA
    assert job_format(GenerationSection(json_schema=json.dumps(SCHEMA))).schema == SCHEMA  # inline
    assert job_format(GenerationSection(choice=["a", "b"])).kind == "choice"
    assert job_format(GenerationSection(response_format={"type": "json_object"})).kind == "json_object"
    assert job_format(GenerationSection()) is None
    with pytest.raises(FormatError, match="--regex and --choice each set the output format: give one"):
        job_format(GenerationSection(regex="a", choice=["b"]))
    with pytest.raises(FormatError, match="neither a file nor inline JSON"):
        job_format(GenerationSection(json_schema="missing.json"))


@pytest.mark.parametrize(("flags", "message"), [
    (["--json-schema", '{"type": "objec"}'], "--json-schema: a JSON schema cannot be compiled: Invalid type: objec"),
    (["--regex", "[0-9]{3"], "--regex: a regular expression cannot be compiled"),
    (["--json-object", "--choice", "x"], "--json-object and --choice each set the output format: give one"),
])
def test_a_bad_job_format_exits_2_before_the_model_loads(tmp_path, monkeypatch, capsys, flags, message):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error was reported")

    monkeypatch.setattr("cbgen.model.load.load_model", refuse)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
