"""The sql stage's sandbox, at the query: every DuckDB file reader refused without `read_files: true` (and each
reading with it), one SELECT statement only (several, or any statement that writes, refused either way)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.errors import CbgenError
from cbgen.pipelines.tables import run_query


@pytest.fixture
def files(tmp_path):
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text("x\n1\n2\n")
    (tmp_path / "t.json").write_text('[{"x": 1}, {"x": 2}]')
    (tmp_path / "t.txt").write_text("hello")
    questions = tmp_path / "questions.parquet"
    pq.write_table(pa.table({"id": ["a", "b"]}), questions)
    return tmp_path, {"questions": questions}


READERS = {
    "read_parquet": "SELECT count(*) AS n FROM read_parquet('{d}/t.parquet')",
    "read_csv": "SELECT count(*) AS n FROM read_csv('{d}/t.csv')",
    "read_json": "SELECT count(*) AS n FROM read_json('{d}/t.json')",
    "read_text": "SELECT count(*) AS n FROM read_text('{d}/t.txt')",
    "glob": "SELECT count(*) AS n FROM glob('{d}/*.csv')",
    "a file named as a table": "SELECT count(*) AS n FROM '{d}/t.csv'",
}


@pytest.mark.parametrize("reader", list(READERS))
def test_every_file_reader_needs_read_files(files, reader):
    directory, tables = files
    query = READERS[reader].format(d=directory)
    with pytest.raises(CbgenError, match="files only with `read_files: true` on the stage"):
        run_query(query, tables)
    assert run_query(query, tables, read_files=True).column("n").to_pylist()[0] >= 1


@pytest.mark.parametrize("read_files", [False, True])
def test_one_select_only_and_no_writes(files, read_files):
    directory, tables = files
    assert run_query("SELECT id FROM questions ORDER BY id", tables, read_files).column("id").to_pylist() == ["a", "b"]
    with pytest.raises(CbgenError, match="one SELECT statement; this one holds 2"):
        run_query("SELECT 1; SELECT id FROM questions", tables, read_files)
    for write in (f"COPY (SELECT id FROM questions) TO '{directory}/out.csv'", "CREATE TABLE t AS SELECT 1",
                  f"ATTACH '{directory}/db.duckdb' AS other", "INSTALL httpfs", "SET threads = 1"):
        with pytest.raises(CbgenError, match="one SELECT statement"):
            run_query(write, tables, read_files)
    assert not (directory / "out.csv").exists() and not (directory / "db.duckdb").exists()
