"""A fuzzed corpus of hostile rows, mixed with good ones, in every input format.

Rows are drawn by hypothesis from generators that know whether each row is good or bad: JSON of every shape, wrong
types, huge and tiny values, invalid UTF-8, control characters, duplicate keys, NaN and Infinity, deep nesting,
OpenAI lines missing parts, per-row settings out of range. The invariants: reading never raises and gives one
record per row; a job never exits 3; every good row is answered; every bad row is exactly one error record that
names its line; nothing else appears.

CI tries a modest number of examples; `CBGEN_FUZZ_EXAMPLES=N` asks for more (N per test).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbgen.cli import run_cli
from cbgen.inputs import open_reader
from cbgen.rows import read_shards

pytestmark = pytest.mark.slow  # hundreds of generated inputs, and jobs on them

EXAMPLES = int(os.environ.get("CBGEN_FUZZ_EXAMPLES", "0"))
FAST = settings(max_examples=EXAMPLES or 150, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=EXAMPLES or 5, deadline=None, suppress_health_check=list(HealthCheck))
VOCAB = 49152  # the tiny test model's (SmolLM2's tokenizer)


@dataclass(frozen=True)
class Row:
    line: bytes  # as written to the file (no newline)
    good: bool  # a good row is answered; a bad one is exactly one error record
    readable: bool = True  # bad already when read (not only when rendered or checked against the model)


def dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# --------------------------------------------------------------------------------------------------------------- #
# good rows

text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40).filter(lambda s: s.strip())
control = st.text(st.characters(codec="ascii", max_codepoint=31), min_size=1, max_size=5)
prompt_text = st.one_of(text, st.tuples(text, control).map("".join))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": prompt_text}),
                    min_size=1, max_size=3).map(lambda m: [*m, {"role": "user", "content": "Go on."}])
good_settings = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0, 0.0, 0.7, 1.3]), "top_p": st.floats(0.05, 1.0), "top_k": st.integers(0, 50),
    "max_new_tokens": st.sampled_from([1, 3, 10**30]), "stop": st.one_of(text, st.lists(text, min_size=1, max_size=3))})
good_object = st.one_of(
    st.builds(lambda p, s: {"prompt": p, **s}, prompt_text, good_settings),
    st.builds(lambda m: {"messages": m}, messages),
    st.builds(lambda ids: {"input_ids": ids}, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)),
)
good_row = good_object.map(lambda row: Row(dumps(row), good=True))

# --------------------------------------------------------------------------------------------------------------- #
# bad rows

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4), max_leaves=12)
no_prompt_keys = st.dictionaries(text.filter(lambda k: k not in ("prompt", "messages", "input_ids", "id")),
                                 json_values, max_size=4)
wrong_prompt = st.one_of(st.integers(), st.floats(allow_nan=True), st.booleans(), st.lists(text, min_size=1),
                         st.dictionaries(text, json_values, min_size=1), st.just(" \t "), st.just(""))
bad_settings = st.one_of(
    st.fixed_dictionaries({"temperature": st.one_of(st.floats(max_value=-0.01), st.just(float("nan")), text)}),
    st.fixed_dictionaries({"top_p": st.one_of(st.floats(1.01, 1e308), st.just(0), st.just(float("inf")))}),
    st.fixed_dictionaries({"top_k": st.one_of(st.integers(max_value=-2), st.floats(0.1, 0.9))}),
    st.fixed_dictionaries({"max_new_tokens": st.one_of(st.integers(max_value=0), text)}),
    st.fixed_dictionaries({"stop": st.one_of(st.just(""), st.lists(text, min_size=17, max_size=20), st.integers())}),
)
bad_messages = st.one_of(
    st.just([]), st.lists(st.integers(), min_size=1),
    st.lists(st.fixed_dictionaries({"role": text.filter(lambda r: r not in ("user", "system", "assistant",
                                                                           "developer", "tool")),
                                    "content": text}), min_size=1),
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.integers()}), min_size=1),
)
bad_readable = st.one_of(
    json_values.filter(lambda v: not isinstance(v, dict)).map(dumps),  # not an object
    no_prompt_keys.map(dumps),
    wrong_prompt.map(lambda p: dumps({"prompt": p})),
    bad_messages.map(lambda m: dumps({"messages": m})),
    st.lists(st.one_of(st.integers(max_value=-1), st.floats(), text), min_size=1).map(
        lambda ids: dumps({"input_ids": ids})),
    st.builds(lambda p, s: dumps({"prompt": p, **s}), text, bad_settings),
    st.just(b'{"prompt": "a", "prompt": 5}'),  # duplicate keys: the last one wins, and 5 is no prompt
    st.sampled_from([b'{"prompt": NaN}', b'{"prompt": Infinity}', b'{"prompt": "x", "temperature": -Infinity}']),
    st.integers(1000, 120_000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"),
    st.binary(min_size=1, max_size=60).map(lambda b: b.replace(b"\n", b"") + b"\xff"),  # invalid UTF-8
    st.text(min_size=1, max_size=30).filter(lambda s: "}" not in s).map(  # broken JSON: never closed
        lambda s: ("{" + s).replace("\n", " ").encode()),
    st.integers(-(10**400), 10**400).map(lambda n: b'{"prompt": ' + str(n).encode() + b"}"),  # huge numbers
)
bad_when_rendered = st.one_of(
    st.lists(st.integers(VOCAB, 10**12), min_size=1, max_size=5).map(lambda ids: dumps({"input_ids": ids})),
    st.integers(300, 400).map(lambda n: dumps({"input_ids": [7] * n})),  # beyond the 256-token context
    st.integers(20_000, 100_000).map(lambda n: dumps({"prompt": "many words " * (n // 11)})),
)
bad_row = st.one_of(bad_readable.map(lambda line: Row(line, good=False)),
                    bad_when_rendered.map(lambda line: Row(line, good=False, readable=False)))
rows = st.lists(st.one_of(good_row, bad_row), min_size=1, max_size=12)

# OpenAI batch lines
def openai_line(i: int, body: dict) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


good_body = st.builds(lambda m, k: {"messages": m, "max_tokens": k}, messages, st.integers(1, 3))
bad_openai = st.one_of(
    st.just({"method": "GET"}), st.just({"url": "/v1/embeddings"}), st.just({"body": "text"}),
    st.just({"body": {"messages": []}}), st.just({"body": {"messages": [{"role": "user", "content": [{"type":
                                                                                                "image_url"}]}]}}),
    st.just({"body": {"messages": [{"role": "user", "content": "x"}], "temperature": -1}}),
    st.just({"body": {"messages": [{"role": "user", "content": "x"}], "n": 0}}),
    st.just({"url": "/v1/completions", "body": {"prompt": ["a", "b"]}}),
    st.just({"custom_id": None}),
)
openai_rows = st.lists(st.one_of(good_body.map(lambda b: ("good", b)), bad_openai.map(lambda o: ("bad", o))),
                       min_size=1, max_size=8)


def write_openai(path: Path, drawn: list) -> list[Row]:
    # the first line is a good request, so the file is recognised as a batch file
    made = [Row(dumps(openai_line(0, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})), True)]
    for i, (kind, value) in enumerate(drawn, 1):
        line = openai_line(i, value) if kind == "good" else openai_line(i, {"messages": [{"role": "user",
                                                                                         "content": "x"}]}) | value
        made.append(Row(dumps(line), kind == "good"))
    path.write_bytes(b"".join(r.line + b"\n" for r in made))
    return made


def write_jsonl(path: Path, drawn: list[Row]) -> list[Row]:
    made = [Row(dumps({"prompt": "Hello there."}), True), *drawn]  # a first row without an id: rows are numbered
    path.write_bytes(b"".join(r.line + b"\n" for r in made))
    return made


# --------------------------------------------------------------------------------------------------------------- #
# reading: never raises, one record per row, bad rows are errors


@FAST
@given(drawn=rows)
def test_reading_hostile_jsonl(tmp_path_factory, drawn):
    path = tmp_path_factory.mktemp("fuzz") / "p.jsonl"
    made = write_jsonl(path, drawn)
    records = list(open_reader(path))
    assert len(records) == len(made)
    for i, (record, row) in enumerate(zip(records, made)):
        assert record.location == f"{path}:{i + 1}"
        if row.good or not row.readable:
            assert record.error is None, (row.line[:200], record.error)
        else:
            assert record.error, row.line[:200]


@FAST
@given(drawn=openai_rows)
def test_reading_hostile_openai_batch_files(tmp_path_factory, drawn):
    path = tmp_path_factory.mktemp("fuzz") / "batch.jsonl"
    made = write_openai(path, drawn)
    records = list(open_reader(path))
    assert [bool(r.error) for r in records] == [not row.good for row in made]


# --------------------------------------------------------------------------------------------------------------- #
# whole jobs on the tiny model


def check_job(tiny_model_dir, path: Path, made: list[Row], out: Path, *extra: str) -> None:
    code = run_cli(["run", str(path), "-o", str(out), "--model", str(tiny_model_dir), "--max-new-tokens", "2", "-q",
                    "--overwrite", *extra])
    assert code in (0, 1)
    written = list(read_shards(out))
    assert len(written) == len(made) and len({r["id"] for r in written}) == len(made)  # nothing else appears
    by_id = {row["id"]: row for row in written}
    for i, expected in enumerate(made):
        row = by_id.get(f"req-{i}") or by_id[str(i)]  # OpenAI lines by custom_id; a line without one by number
        if expected.good:
            assert row["error"] is None and row["finish_reason"] in ("stop", "length"), (expected.line[:200], row)
        else:
            assert row["finish_reason"] == "error" and row["error"].startswith(f"{path}:{i + 1}: "), row
    assert code == (1 if any(not r.good for r in made) else 0)


@SLOW
@given(drawn=rows)
def test_jobs_on_hostile_jsonl(tiny_model_dir, tmp_path_factory, drawn):
    folder = tmp_path_factory.mktemp("fuzz")
    made = write_jsonl(folder / "p.jsonl", drawn)
    check_job(tiny_model_dir, folder / "p.jsonl", made, folder / "out")


@SLOW
@given(drawn=openai_rows)
def test_jobs_on_hostile_openai_batch_files(tiny_model_dir, tmp_path_factory, drawn):
    folder = tmp_path_factory.mktemp("fuzz")
    made = write_openai(folder / "batch.jsonl", drawn)
    check_job(tiny_model_dir, folder / "batch.jsonl", made, folder / "out")


# Parquet files and datasets have a schema: the hostile values are within each column's type
column_rows = st.lists(st.one_of(
    st.builds(lambda p, t: ({"prompt": p, "temperature": t, "top_k": None}, True), prompt_text,
              st.sampled_from([None, 0.0, 0.8])),
    st.builds(lambda p: ({"prompt": p, "temperature": None, "top_k": None}, False),
              st.sampled_from([None, "", "   ", "\n"])),
    st.builds(lambda t: ({"prompt": "hi", "temperature": t, "top_k": None}, False),
              st.sampled_from([-1.0, float("nan"), float("inf")])),
    st.builds(lambda k: ({"prompt": "hi", "temperature": None, "top_k": k}, False), st.integers(-(2**40), -2)),
    st.builds(lambda n: ({"prompt": "words " * n, "temperature": None, "top_k": None}, False),
              st.integers(20_000, 50_000)),
), min_size=1, max_size=10)


@SLOW
@pytest.mark.parametrize("kind", ["parquet", "dataset"])
@given(drawn=column_rows)
def test_jobs_on_hostile_columns(tiny_model_dir, tmp_path_factory, kind, drawn):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("fuzz")
    table = pa.Table.from_pylist([row for row, _ in drawn],
                                 schema=pa.schema([("prompt", pa.string()), ("temperature", pa.float64()),
                                                   ("top_k", pa.int64())]))
    if kind == "parquet":
        path = folder / "p.parquet"
        pq.write_table(table, path)
    else:
        import datasets

        path = folder / "saved"
        datasets.Dataset(table).save_to_disk(str(path))
    code = run_cli(["run", str(path), "-o", str(folder / "out"), "--model", str(tiny_model_dir), "--max-new-tokens",
                    "2", "-q"])
    assert code == (1 if any(not good for _, good in drawn) else 0)
    written = {row["id"]: row for row in read_shards(folder / "out")}
    assert sorted(written, key=int) == [str(i) for i in range(len(drawn))]
    for i, (_, good) in enumerate(drawn):
        assert (written[str(i)]["error"] is None) == good, written[str(i)]
        if not good:
            assert f"row {i + 1}: " in written[str(i)]["error"]
