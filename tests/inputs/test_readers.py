"""Tests of the input readers on real files written to tmp_path."""

from __future__ import annotations

import gzip
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.errors import CbgenError
from cbgen.inputs import open_reader

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def write_jsonl(path: Path, rows: list) -> Path:
    """Write rows as JSONL; a str row is written verbatim, so tests can put broken lines in."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read(path, **options) -> list:
    return list(open_reader(path, **options))


def test_jsonl_prompt_messages_and_input_ids(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello"}, {"messages": MESSAGES}, {"input_ids": [1, 2, 3]}])
    a, b, c = read(path)
    assert (a.id, a.index, a.location, a.prompt, a.messages, a.input_ids, a.error) == (
        "0", 0, f"{path}:1", "Hello", None, None, None)
    assert (b.id, b.messages, b.prompt, b.error) == ("1", MESSAGES, None, None)
    assert (c.id, c.input_ids, c.location, c.error) == ("2", [1, 2, 3], f"{path}:3", None)


def test_json_ndjson_and_gzip_suffixes(tmp_path):
    for name in ("p.json", "p.ndjson"):
        assert read(write_jsonl(tmp_path / name, [{"prompt": "x"}]))[0].prompt == "x"
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"prompt": "zipped"}\n\n{"prompt": "two"}\n'))
    reader = open_reader(gz)
    assert [r.prompt for r in reader] == ["zipped", "two"]
    assert reader.count() == 2


def test_not_gzip_is_a_file_error(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(CbgenError, match=r"is not a valid gzip file"):
        open_reader(path)


def test_id_column_str_and_int(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"uid": "a", "prompt": "x"}, {"uid": 7, "prompt": "y"}])
    assert [r.id for r in read(path, id_column="uid")] == ["a", "7"]


@pytest.mark.parametrize("uid", [None, "", "  ", 1.5, True, [1]])
def test_bad_id_is_a_row_error(tmp_path, uid):
    row = {"prompt": "x"} if uid is None else {"uid": uid, "prompt": "x"}
    path = write_jsonl(tmp_path / "p.jsonl", [{"uid": "a", "prompt": "x"}, row, {"uid": "c", "prompt": "z"}])
    a, bad, c = read(path, id_column="uid")
    assert (a.id, a.error, c.id, c.error) == ("a", None, "c", None)
    assert bad.id == "1" and "'uid'" in bad.error and bad.prompt is None


def test_keep_columns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "lang": "en", "meta": {"k": [1]}}, {"prompt": "y"}])
    a, b = read(path, keep_columns=["lang", "meta"])
    assert a.kept == {"lang": "en", "meta": {"k": [1]}}
    assert b.kept == {"lang": None, "meta": None}
    assert open_reader(path).kept_schema is None


@pytest.mark.parametrize("name", ["text", "id", "error", "finish_reason", "logprobs"])
def test_reserved_kept_column(tmp_path, name):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(CbgenError, match=rf"--keep-columns '{name}' is a reserved output name; rename the column"):
        open_reader(path, keep_columns=[name])


BAD_ROWS = [
    ('{"prompt": "x"', "invalid JSON: "),
    ("[1, 2]", "expected a JSON object per line, got a list"),
    ('"just a string"', "expected a JSON object per line, got a string"),
    ({"prompt": ""}, "'prompt' is empty or whitespace only"),
    ({"prompt": " \n\t"}, "'prompt' is empty or whitespace only"),
    ({"prompt": 3}, "'prompt' must be a string, got an integer"),
    ({"prompt": ["a", "b"]}, "'prompt' must be a string, got a list"),
    ({"messages": []}, "'messages' is an empty list"),
    ({"messages": "hi"}, "'messages' must be a list of messages, got a string"),
    ({"messages": ["hi"]}, "'messages' message 0 must be an object with 'role' and 'content', got a string"),
    ({"messages": [MESSAGES[0], {"role": "bot", "content": "x"}]}, "'messages' message 1 has role 'bot'; expected"),
    ({"messages": [{"content": "x"}]}, "'messages' message 0 has no role"),
    ({"messages": [{"role": "user"}]}, "'messages' message 0 has no content"),
    ({"messages": [{"role": "user", "content": 5}]}, "'messages' message 0 has content that is an integer"),
    ({"input_ids": []}, "'input_ids' is an empty list"),
    ({"input_ids": [1, -2]}, "'input_ids' must be a list of non-negative integers; item 1 is -2"),
    ({"input_ids": [1, True]}, "item 1 is True"),
    ({"input_ids": [1, 2.0]}, "item 1 is 2.0"),
    ({"input_ids": "1 2"}, "'input_ids' must be a list of token ids, got a string"),
    ({"prompt": "x", "messages": MESSAGES}, "several prompt fields (prompt, messages)"),
    ({"question": "x", "lang": "en"}, "the row has question, lang; name the prompt field with --prompt-column"),
    ({"prompt": None}, "the prompt field 'prompt' is null"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_ROWS)
def test_row_errors_do_not_stop_reading(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "before", "k": 1}, bad, {"input_ids": [5], "k": 3}])
    before, record, after = read(path, keep_columns=["k"])
    assert (before.prompt, before.error, before.kept) == ("before", None, {"k": 1})
    assert (after.input_ids, after.error, after.index, after.id) == ([5], None, 2, "2")
    assert message in record.error and "\n" not in record.error
    assert (record.id, record.index, record.location) == ("1", 1, f"{path}:2")
    assert record.prompt is record.messages is record.input_ids is None


def test_multimodal_content_list_and_null_struct_fields(tmp_path):
    parts = [{"type": "text", "text": "hi"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": parts, "name": None}]}])
    (record,) = read(path)
    assert record.error is None and record.messages == [{"role": "user", "content": parts}]


def test_prompt_column_value_decides_kind(tmp_path):
    rows = [{"q": "text"}, {"q": MESSAGES}, {"q": [4, 5]}, {"q": 3}, {"q": None}, {"q": [{"role": "user"}]}]
    a, b, c, d, e, f = read(write_jsonl(tmp_path / "p.jsonl", rows), prompt_column="q")
    assert (a.prompt, b.messages, c.input_ids) == ("text", MESSAGES, [4, 5])
    assert d.error == "'q' must be a string, a list of messages or a list of token ids, got an integer"
    assert e.error == "the prompt field 'q' is missing or null"
    assert f.error.startswith("'q' message 0 has no content")


def test_blank_lines_are_skipped_and_not_counted(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ["", {"prompt": "a"}, "   ", "", {"prompt": "b"}, "\t"])
    reader = open_reader(path)
    records = list(reader)
    assert [(r.id, r.index, r.location) for r in records] == [("0", 0, f"{path}:2"), ("1", 1, f"{path}:5")]
    assert reader.count() == 2


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n{"prompt": "\xc3\xa9"}\n')
    a, bad, c = read(path)
    assert (a.prompt, c.prompt) == ("ok", "é")
    assert bad.error.startswith("invalid UTF-8") and bad.location == f"{path}:2"


def test_utf8_bom_on_first_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "x"}\n')
    assert read(path)[0].prompt == "x"


def test_stdin(monkeypatch):
    data = b'{"prompt": "a", "uid": "x"}\n\n{"messages": [{"role": "user", "content": "b"}]}\nnot json\n'
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(data)))
    reader = open_reader("-", id_column="uid")
    assert reader.name == "<stdin>" and reader.count() is None
    reader.check_ids()  # a no-op: stdin can be read only once
    a, b, c = list(reader)
    assert (a.id, a.prompt, a.location) == ("x", "a", "<stdin>:1")
    assert (b.location, b.error) == ("<stdin>:3", "the id field 'uid' is missing, null or empty")
    assert (c.id, c.location) == ("2", "<stdin>:4") and c.error.startswith("invalid JSON: ")


def test_count_streams_non_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(100)] + ["", "oops"])
    assert open_reader(path).count() == 101


def test_duplicate_ids_jsonl(tmp_path):
    rows = [{"uid": "a", "prompt": "x"}, {"uid": "b", "prompt": "x"}, "{broken", {"uid": 1, "prompt": "x"},
            {"prompt": "no id"}, {"uid": "1", "prompt": "x"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(CbgenError) as e:
        open_reader(path, id_column="uid").check_ids()
    assert str(e.value) == (f"{path}:6: duplicate id '1' (first seen on line 4); the ids in field 'uid' must "
                            "be unique: fix the file, or drop --id-column to number the rows")
    open_reader(path).check_ids()  # default ids are unique by construction
    write_jsonl(path, rows[:5])
    open_reader(path, id_column="uid").check_ids()


def test_missing_file(tmp_path):
    for name in ("nope.jsonl", "nope.parquet"):
        with pytest.raises(CbgenError, match=rf"^input file '.*{name}' does not exist$"):
            open_reader(tmp_path / name)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt\nx\n")
    with pytest.raises(CbgenError, match=r"^cannot read '.*p.csv': unsupported input format; use a .jsonl"):
        open_reader(path)


def test_unreadable_file(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    real_open = open

    def deny(file, *args, **kwargs):  # chmod does not stop root, who runs CI: simulate the refusal instead
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(CbgenError, match=r"cannot read input file .*: permission denied"):
        open_reader(path)


# Parquet


def write_parquet(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=700)
    return path


def test_parquet_streams_many_rows_in_order(tmp_path, monkeypatch):
    n = 2500
    path = write_parquet(tmp_path / "d.parquet", {"uid": [f"r{i}" for i in range(n)],
                                                  "prompt": [f"p{i}" for i in range(n)], "unused": list(range(n))})
    seen_columns = []
    real_iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        seen_columns.append((kwargs.get("batch_size"), kwargs.get("columns")))
        return real_iter_batches(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    reader = open_reader(path, id_column="uid")
    assert reader.count() == n
    reader.check_ids()
    records = list(reader)
    assert seen_columns == [(1024, ["uid"]), (1024, ["prompt", "uid"])]
    assert [r.id for r in records] == [f"r{i}" for i in range(n)]
    assert [r.prompt for r in records] == [f"p{i}" for i in range(n)]
    assert records[-1].location == f"{path} row {n}" and records[-1].index == n - 1
    assert all(r.error is None for r in records)


def test_parquet_prompt_column_and_default_ids(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", {"question": ["a", "", None], "prompt": ["x", "y", "z"]})
    a, b, c = read(path, prompt_column="question")
    assert (a.id, a.prompt, a.location) == ("0", "a", f"{path} row 1")
    assert b.error == "'question' is empty or whitespace only"
    assert c.error == "the prompt field 'question' is missing or null"


def test_parquet_messages_and_input_ids_columns(tmp_path):
    other = [{"role": "user", "content": "Yo"}]
    path = write_parquet(tmp_path / "d.parquet", {"messages": [MESSAGES, other, None],
                                                  "input_ids": [None, None, [3, 4]], "uid": [10, 11, 12]})
    assert pa.types.is_list(pq.read_schema(path).field("messages").type)
    a, b, c = read(path, id_column="uid")
    assert (a.id, a.messages, b.messages, c.input_ids) == ("10", MESSAGES, other, [3, 4])
    assert all(r.error is None for r in (a, b, c))


def test_parquet_missing_prompt_column_lists_columns(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", {"question": ["a"], "lang": ["en"]})
    with pytest.raises(CbgenError) as e:
        open_reader(path)
    assert str(e.value) == (f"'{path}' has none of the columns prompt, messages, input_ids; its columns are: "
                            "question, lang; name the prompt column with --prompt-column")
    with pytest.raises(CbgenError, match=r"has no column 'q' \(--prompt-column\); its columns are: question, lang$"):
        open_reader(path, prompt_column="q")


def test_parquet_missing_id_or_kept_column(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", {"prompt": ["a"], "lang": ["en"]})
    with pytest.raises(CbgenError, match=r"has no column 'uid' \(--id-column\); its columns are: prompt, lang$"):
        open_reader(path, id_column="uid")
    with pytest.raises(CbgenError, match=r"has no column 'x' \(--keep-columns\); its columns are: prompt, lang$"):
        open_reader(path, keep_columns=["lang", "x"])


def test_parquet_kept_columns_and_schema(tmp_path):
    table = pa.table({"prompt": ["a", "b"], "score": pa.array([1.5, None], pa.float32()),
                      "tags": pa.array([["x"], []], pa.list_(pa.string())), "n": pa.array([1, 2], pa.int16())})
    pq.write_table(table, tmp_path / "d.parquet")
    reader = open_reader(tmp_path / "d.parquet", keep_columns=["tags", "score"])
    assert reader.kept_schema == pa.schema([("tags", pa.list_(pa.string())), ("score", pa.float32())])
    assert [r.kept for r in reader] == [{"tags": ["x"], "score": 1.5}, {"tags": [], "score": None}]


def test_parquet_duplicate_ids(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", {"uid": ["a", None, "b", "a"], "prompt": ["x"] * 4})
    with pytest.raises(CbgenError) as e:
        open_reader(path, id_column="uid").check_ids()
    assert str(e.value) == (f"{path} row 4: duplicate id 'a' (first seen in row 1); the ids in field 'uid' must "
                            "be unique: fix the file, or drop --id-column to number the rows")


def test_parquet_directory_in_sorted_order(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_parquet(data / "part-1.parquet", {"prompt": ["c"], "uid": ["3"]})
    write_parquet(data / "part-0.parquet", {"prompt": ["a", "b"], "uid": ["1", "2"]})
    (data / "README.txt").write_text("not data")
    reader = open_reader(data, id_column="uid")
    assert reader.name == str(data) and reader.count() == 3
    reader.check_ids()
    records = list(reader)
    assert [(r.id, r.index, r.prompt) for r in records] == [("1", 0, "a"), ("2", 1, "b"), ("3", 2, "c")]
    assert records[2].location == f"{data / 'part-1.parquet'} row 1"
    write_parquet(data / "part-2.parquet", {"prompt": ["d"], "uid": ["2"]})
    with pytest.raises(CbgenError, match=r"part-2.parquet row 1: duplicate id '2' \(first seen in .*part-0.parquet "
                                         r"row 2\)"):
        open_reader(data, id_column="uid").check_ids()


def test_parquet_empty_directory(tmp_path):
    expected = r"^input directory '.*' contains no data files \(.parquet, .*\) and is not a dataset saved"
    with pytest.raises(CbgenError, match=expected):
        open_reader(tmp_path)


def test_not_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_text("prompt\nx\n")
    with pytest.raises(CbgenError, match=r"^input file '.*d.parquet' is not a valid Parquet file: ") as e:
        open_reader(path)
    assert "\n" not in str(e.value)


def test_every_input_format_has_a_reader_and_a_choice():
    """--input-format's choices are the formats registry's (and auto); each names a reader class of that format."""
    import typing

    from cbgen.config.sections import InputSection
    from cbgen.inputs import FORMATS
    from cbgen.inputs.base import Reader

    choices = set(typing.get_args(typing.get_type_hints(InputSection)["format"]))
    assert choices == set(FORMATS) | {"auto"}
    for fmt, where in FORMATS.items():
        module, name = where.split(":")
        reader = getattr(__import__(module, fromlist=[name]), name)
        assert issubclass(reader, Reader) and reader.FORMAT == fmt
