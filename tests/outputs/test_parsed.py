"""`parsed`: a JSON answer as data. Its Parquet type follows the job's JSON schema (structs, lists, scalars; JSON text
where no single type holds), and `datasets` reads the schema's fields; null when the answer was cut or failed."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from cbgen.rows.parsed import ParsedType
from tests.helpers import write_jsonl

ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


def test_types_follow_the_schema():
    person = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": ["integer", "null"]}, "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
        "extra": {"type": "object"}, "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "level": {"enum": [1, 2, 3]}}}
    parsed = ParsedType.of(person)
    assert parsed.type == pa.struct([
        ("name", pa.string()), ("age", pa.int64()), ("score", pa.float64()), ("tags", pa.list_(pa.string())),
        ("ok", pa.bool_()), ("address", pa.struct([("city", pa.string())])), ("extra", pa.string()),
        ("either", pa.string()), ("level", pa.int64())])
    value = {"name": "Ada", "age": None, "score": 3, "tags": ["x"], "ok": True, "address": {"city": "Lima"},
             "extra": {"free": [1, 2]}, "either": 7, "level": 2}
    converted = parsed.convert(value)
    assert converted["extra"] == '{"free": [1, 2]}' and converted["either"] == "7"  # JSON text where no type holds
    assert pa.array([converted, None], type=parsed.type).to_pylist()[0]["address"] == {"city": "Lima"}
    assert ParsedType.of(None).type == pa.string()  # no single schema: JSON text


def run(tiny_model_dir, path, out, *flags) -> int:
    return run_cli(["run", str(path), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "-q",
                    *map(str, flags)])


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Is {i} small? Answer in JSON."}
                                              for i in range(6)])


def test_parquet_parsed_has_the_schemas_fields_and_datasets_reads_them(tiny_model_dir, prompts, tmp_path):
    import datasets

    out = tmp_path / "out"
    assert run(tiny_model_dir, prompts, out, "--json-schema", json.dumps(ANSWER), "--output-format", "parquet",
               "--max-new-tokens", 40) == 0
    rows = list(read_shards(out))
    assert all(r["finish_reason"] == "stop" and r["parsed"] == json.loads(r["text"]) for r in rows)
    schema = pq.read_schema(next(out.glob("part-*.parquet")))
    assert schema.field("parsed").type == pa.struct([("answer", pa.string()), ("n", pa.int64())])
    dataset = datasets.load_dataset("parquet", data_files=str(out / "part-*.parquet"), split="train")
    assert dataset.features["parsed"] == {"answer": datasets.Value("string"), "n": datasets.Value("int64")}
    assert dataset.flatten().column_names[-2:] == ["parsed.answer", "parsed.n"]


def test_cut_answers_parse_to_null_and_jsonl_holds_the_value(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    assert run(tiny_model_dir, prompts, out, "--json-schema", json.dumps(ANSWER), "--max-new-tokens", 3) == 0
    rows = list(read_shards(out))
    assert all(r["finish_reason"] == "length" and r["parsed"] is None for r in rows)  # cut: never claimed parsed


@pytest.mark.embedded
def test_json_objects_end_and_parse_on_a_real_model(tmp_path):
    """--json-object: any object. The tiny random model never closes one (its strings run on to the token cap), so
    this runs on the embedded model, whose objects end: each ended answer's `parsed` is its text as JSON, and a cut
    one's is null."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Give a JSON object with the key n set to "
                                               f"{i} and the key ok set to true."} for i in range(4)])
    out = tmp_path / "out"
    assert run_cli(["run", str(path), "-o", str(out), "--json-object", "--max-new-tokens", "60", "-q"]) == 0
    written = list(read_shards(out))
    stopped = [r for r in written if r["finish_reason"] == "stop"]
    assert len(stopped) >= 3, [r["text"] for r in written]
    assert all(isinstance(r["parsed"], dict) and r["parsed"] == json.loads(r["text"]) for r in stopped)
    assert all(r["parsed"] is None for r in written if r["finish_reason"] == "length")


def test_rows_with_their_own_formats_get_json_text_in_parquet(tiny_model_dir, tmp_path):
    rows = [{"id": "a", "prompt": "one", "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "a", "schema": ANSWER}}},
            {"id": "b", "prompt": "two", "response_format": {"type": "regex", "pattern": "[0-9]{2}"}},
            {"id": "c", "prompt": "three"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    assert run(tiny_model_dir, path, out, "--output-format", "parquet", "--max-new-tokens", 40) == 0
    assert pq.read_schema(next(out.glob("part-*.parquet"))).field("parsed").type == pa.string()
    parsed = {r["id"]: r["parsed"] for r in read_shards(out)}
    assert json.loads(parsed["a"])["answer"] in ("yes", "no")
    assert parsed["b"] is None and parsed["c"] is None  # a regex answer is text, not data
