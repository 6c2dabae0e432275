"""`cbgen merge` and `cbgen merge --to-dataset` keep every column a job's rows have, in every output format, for
split jobs and whole ones: the columns are decided once, stored with the job, and read back by the merge."""

from __future__ import annotations

import json

import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

# Columns a row has besides the base fields, by how the job asks for them.
ASKED = {
    "job": (["--logprobs", "--top-logprobs", "2"], {"logprobs", "top_logprobs"}),
    "row": ([], {"logprobs", "top_logprobs"}),  # only one row asks, with its own top_logprobs
    "replies": (["--response-template", "think"], {"reasoning", "tool_calls"}),
    "json": (["--json-schema", json.dumps({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                                           "required": ["answer"], "additionalProperties": False})], {"parsed"}),
}


@pytest.fixture
def prompts(tmp_path):
    rows = [{"id": f"q{i}", "prompt": f"Name a colour, number {i}.", "topic": f"t{i % 3}",
             "meta": {"rank": i, "tags": ["a", "b"][: i % 3]}} for i in range(10)]
    rows[3]["top_logprobs"] = 3
    return write_jsonl(tmp_path / "p.jsonl", rows)


def columns_of(rows: list[dict]) -> set[str]:
    return set().union(*(row.keys() for row in rows))


def by_id(rows: list[dict]) -> dict[tuple[str, int], dict]:
    return {(row["id"], row["sample_index"]): row for row in rows}


def close(a, b) -> bool:
    """Equal, with floats compared at float32 precision (Parquet stores logprobs as float32)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 * max(1.0, abs(a))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_rows(merged: list[dict], originals: list[dict]) -> None:
    assert columns_of(merged) == columns_of(originals)
    left, right = by_id(merged), by_id(originals)
    assert left.keys() == right.keys()
    for key, row in right.items():
        assert close(left[key], row), key


def run_job(tiny_model_dir, prompts, out, fmt, extra, shards):
    common = [str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--max-new-tokens", "4",
              "--output-format", fmt, "--keep-columns", "topic,meta", "-q", *extra]
    if shards is None:
        assert run_cli(["run", *common]) == 0
        return [out]
    for index in range(shards):
        assert run_cli(["run", *common, "--num-shards", str(shards), "--shard-index", str(index)]) == 0
    return sorted(out.glob("shard-*"))


@pytest.mark.parametrize("asked", sorted(ASKED))
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_merge_of_a_split_job_keeps_every_column(tiny_model_dir, prompts, tmp_path, fmt, asked):
    flags, expected = ASKED[asked]
    directories = run_job(tiny_model_dir, prompts, tmp_path / "out", fmt, flags, shards=2)
    originals = [row for d in directories for row in read_shards(d)]
    assert expected | {"topic", "meta"} <= columns_of(originals)
    assert run_cli(["merge", str(tmp_path / "out")]) == 0
    merged = list(read_shards(tmp_path / "out" / "merged"))
    assert {p.suffix for p in (tmp_path / "out" / "merged").glob("part-*")} == {f".{fmt}"}
    assert_same_rows(merged, originals)


@pytest.mark.slow
@pytest.mark.parametrize("shards", [None, 2])
@pytest.mark.parametrize("asked", sorted(ASKED))
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_merge_to_dataset_keeps_every_column(tiny_model_dir, prompts, tmp_path, fmt, asked, shards):
    import datasets

    flags, expected = ASKED[asked]
    directories = run_job(tiny_model_dir, prompts, tmp_path / "out", fmt, flags, shards)
    originals = [row for d in directories for row in read_shards(d)]
    assert run_cli(["merge", str(tmp_path / "out"), "--to-dataset", "-o", str(tmp_path / "ds")]) == 0
    dataset = datasets.load_from_disk(str(tmp_path / "ds"))
    assert set(dataset.column_names) == columns_of(originals) >= expected
    assert_same_rows(list(dataset), originals)


@pytest.mark.slow
def test_merge_of_openai_lines_keeps_them_whole(tiny_model_dir, tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 3, "logprobs": True,
                       "top_logprobs": 2}} for i in range(6)]
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    for index in range(2):
        assert run_cli(["run", str(path), "-o", str(out), "--model", str(tiny_model_dir), "--output-format", "openai",
                        "--num-shards", "2", "--shard-index", str(index), "-q"]) == 0
    originals = [line for d in sorted(out.glob("shard-*")) for line in read_shards(d, as_rows=False)]
    assert run_cli(["merge", str(out)]) == 0
    merged = list(read_shards(out / "merged", as_rows=False))
    assert sorted(merged, key=lambda line: line["custom_id"]) == sorted(originals, key=lambda x: x["custom_id"])
    assert all(line["response"]["body"]["choices"][0]["logprobs"]["content"] for line in merged)


def test_status_reports_the_columns(tiny_model_dir, prompts, tmp_path, capsys):
    run_job(tiny_model_dir, prompts, tmp_path / "out", "parquet", ["--top-logprobs", "2"], shards=None)
    capsys.readouterr()
    assert run_cli(["status", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"logprobs", "top_logprobs", "topic", "meta", "text", "token_ids"} <= set(report["columns"])
    assert "reasoning" not in report["columns"]
