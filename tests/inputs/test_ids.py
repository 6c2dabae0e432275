"""Which field names a row: --id-column, else the rows' own `id` field, else (or with @row) the row number; OpenAI
batch lines by their custom_id. Every reader behaves the same."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.errors import CbgenError
from cbgen.inputs import ROW_NUMBER, open_reader
from tests.helpers import write_jsonl

ROWS = [{"id": "q-7", "prompt": "a", "uid": 70}, {"id": "q-9", "prompt": "b", "uid": 90}]


def ids(reader) -> list[str]:
    return [record.id for record in reader]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset"])
def test_the_rows_own_id_field_is_the_id(tmp_path, kind):
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    elif kind == "parquet":
        path = write_parquet(tmp_path / "p.parquet", ROWS)
    else:
        import datasets

        datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
        path = tmp_path / "saved"
    reader = open_reader(path)
    assert (reader.id_column, reader.id_choice) == ("id", "the rows' own id field")
    assert ids(reader) == ["q-7", "q-9"]
    assert ids(open_reader(path, id_column="uid")) == ["70", "90"]  # --id-column overrides
    assert ids(open_reader(path, id_column=ROW_NUMBER)) == ["0", "1"]  # @row numbers the rows
    assert open_reader(path, id_column=ROW_NUMBER).id_choice == "row number"
    assert ids(open_reader(path, detect_id=False)) == ["0", "1"]  # how a directory of an older format resumes


def test_rows_without_an_id_field_are_numbered(tmp_path):
    reader = open_reader(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b", "id": "late"}]))
    assert reader.id_column is None and ids(reader) == ["0", "1"]  # decided by the first row


def test_a_row_missing_the_detected_id_is_an_error_record(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ["not json", {"id": "a", "prompt": "x"}, {"prompt": "y"}])
    records = list(open_reader(path))
    assert [r.id for r in records[:2]] == ["0", "a"]
    assert records[2].error == "the id field 'id' is missing, null or empty"


def test_stdin_rows_with_ids(monkeypatch):
    data = b'\n{"id": "x1", "prompt": "a"}\n{"id": "x2", "prompt": "b"}\n'
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(data)))
    reader = open_reader("-")
    assert reader.id_column == "id"
    assert [(r.id, r.location) for r in reader] == [("x1", "<stdin>:2"), ("x2", "<stdin>:3")]


def test_duplicate_detected_ids_say_how_to_number_rows_instead(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    with pytest.raises(CbgenError) as e:
        open_reader(path).check_ids()
    assert str(e.value) == (f"{path}:2: duplicate id '1' (first seen on line 1); the ids in field 'id' must be "
                            "unique: fix the file, or pass --id-column @row to number the rows instead")
    open_reader(path, id_column=ROW_NUMBER).check_ids()  # the way out works


def test_openai_batch_lines_are_known_by_custom_id(tmp_path):
    line = {"custom_id": "c-1", "id": "ignored", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi"}}
    reader = open_reader(write_jsonl(tmp_path / "b.jsonl", [line]))
    assert (reader.id_column, ids(reader)) == ("custom_id", ["c-1"])
