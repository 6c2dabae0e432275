"""A stage's table: what the stages after it read of it, as their input or as a table in SQL.

The table of a generate or score stage S whose input has columns C is:

    id           the row's id; with "-K" appended for sequence K when S asks for several per prompt (--n)
    C minus id   its input's columns, carried on (the struct of each stage before it among them)
    S            a struct of S's own fields: id, text, parsed, finish_reason, ... or the score fields

so `{{ questions.text }}` in a template, or `questions.parsed.question` in SQL, reads stage `questions`' answer
whatever stages come after it. Rows that failed are left out (they stay in S's output directory with their error).
The table of an sql stage is its result, as it is.

The same SELECT makes a table from a finished stage's rows (`write_stage_table`) and infers its schema before
anything runs, over empty rows of the stage's output schema (`infer_stage_table`): what is checked is what runs.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from cbgen.errors import CbgenError
from cbgen.files import fsync_directory
from cbgen.pipelines.spec import SQL_FILES_KEY, sql_message

if TYPE_CHECKING:
    import duckdb

    from cbgen.config import JobConfig
    from cbgen.rows.columns import OutputColumns

ROW_GROUP = 10_000


def quote(name: str) -> str:
    """An SQL identifier, quoted."""
    return '"' + name.replace('"', '""') + '"'


def connect() -> duckdb.DuckDBPyConnection:
    import duckdb

    return duckdb.connect(":memory:")


def carried_columns(schema: pa.Schema, reserved: frozenset[str]) -> tuple[list[str], list[str]]:
    """The input columns a stage carries on, and those it cannot (its own rows have a field of that name)."""
    names = [n for n in schema.names if n != "id"]
    return [n for n in names if n not in reserved], [n for n in names if n in reserved]


def select_table(name: str, job: JobConfig, columns: OutputColumns, rows: str) -> str:
    """The SELECT of stage `name`'s table from its output rows (`rows`: an SQL relation), with `__position` (its
    input row's) and `__sample` for putting the rows in order."""
    own = [c for c in columns.names if c not in columns.kept and c != "error"]
    several = columns.of_kind.samples_per_row(job) > 1
    sample = columns.of_kind.sample_column()
    ident = f"id || '-' || CAST({sample} AS VARCHAR)" if several else "id"
    fields = ", ".join(f"{quote(c)} := {quote(c)}" for c in own)
    carried = "".join(f", {quote(c)}" for c in columns.kept)
    return (f"SELECT {ident} AS id{carried}, struct_pack({fields}) AS {quote(name)}, id AS __key, {sample} AS __sample "
            f"FROM {rows} WHERE error IS NULL")


def infer_stage_table(name: str, job: JobConfig, columns: OutputColumns, output: pa.Schema) -> pa.Schema:
    """The schema of stage `name`'s table, from the schema of its output rows."""
    con = connect()
    con.register("rows", output.empty_table())
    table = con.sql(f"SELECT * EXCLUDE (__key, __sample) FROM ({select_table(name, job, columns, 'rows')})")
    return table.to_arrow_table().schema


def _sandboxed(con: duckdb.DuckDBPyConnection, read_files: bool) -> None:
    """Unless the stage opts in, DuckDB reads nothing but the tables registered (files, extensions, attached
    databases and COPY all refused), and the query cannot turn that back on."""
    if not read_files:
        con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _run(con: duckdb.DuckDBPyConnection, query: str, read_files: bool) -> pa.Table:
    import duckdb

    _sandboxed(con, read_files)
    try:
        statements = con.extract_statements(query)
        if len(statements) != 1:
            raise CbgenError(f"an sql stage's query is one SELECT statement; this one holds {len(statements)}: keep "
                             "one (a WITH clause can name the steps before it)")
        kind = statements[0].type
        if kind != duckdb.StatementType.SELECT:
            raise CbgenError(f"an sql stage's query is one SELECT statement (it reads, and writes nothing, "
                             f"`{SQL_FILES_KEY}: true` or not); this one is {kind.name}")
        return con.sql(query).to_arrow_table()
    except duckdb.PermissionException as e:
        raise CbgenError(f"SQL error: {sql_message(e)}; an sql stage reads the tables of the stages it names, and "
                         f"files only with `{SQL_FILES_KEY}: true` on the stage") from None
    except duckdb.Error as e:
        raise CbgenError(f"SQL error: {sql_message(e)}") from None


def infer_query(query: str, tables: dict[str, pa.Schema], read_files: bool = False) -> pa.Schema:
    """The schema of an sql stage's result over empty tables of the schemas it reads; DuckDB's error as a
    CbgenError (the caller names the stage)."""
    con = connect()
    for name, schema in tables.items():
        con.register(name, schema.empty_table())
    return _run(con, query, read_files).schema


def write_stage_table(name: str, job: JobConfig, columns: OutputColumns, files: Sequence[Path],
                      order: Sequence[str], target: Path) -> int:
    """Writes stage `name`'s table from its output shards `files`, its rows in the order of their ids in the
    input (`order`); returns the number of rows."""
    con = connect()
    con.register("positions", pa.table({"__id": list(order), "__position": range(len(order))}))
    rows = f"read_parquet([{', '.join(_literal(f) for f in files)}], union_by_name = true)"
    table = con.sql(f"SELECT t.* EXCLUDE (__key, __sample) FROM ({select_table(name, job, columns, rows)}) t "
                    "JOIN positions p ON t.__key = p.__id ORDER BY p.__position, t.__sample").to_arrow_table()
    write_parquet(table, target)
    return table.num_rows


def run_query(query: str, tables: dict[str, Path], read_files: bool = False) -> pa.Table:
    """An sql stage's result over the tables (Parquet files) it reads: each handed to DuckDB as an Arrow dataset,
    which the query reads without any file access of its own (see `_sandboxed`)."""
    import pyarrow.dataset as ds

    con = connect()
    for name, path in tables.items():
        con.register(name, ds.dataset(path, format="parquet"))
    return _run(con, query, read_files)


def write_parquet(table: pa.Table, target: Path) -> None:
    """`table` as one Parquet file at `target`, atomically; the same rows always give the same bytes (their
    digest is what later stages' fingerprints hold)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # unique, as the tasks of one Slurm array may each write the table of the stage they read at once
    temporary = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        pq.write_table(table.combine_chunks(), temporary, row_group_size=ROW_GROUP)
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(target.parent)


def empty_file(schema: pa.Schema, target: Path) -> Path:
    """An empty Parquet file of `schema`: what a stage's input will be, for checking the stage against it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(schema.empty_table(), target)
    return target


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def struct_fields(schema: pa.Schema, column: str) -> list[str] | None:
    """The field names of a struct column, None for a column of another type."""
    type_: Any = schema.field(column).type
    return [type_.field(i).name for i in range(type_.num_fields)] if pa.types.is_struct(type_) else None


def _literal(path: Path | str) -> str:
    return "'" + str(path).replace("'", "''") + "'"
