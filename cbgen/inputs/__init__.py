"""Input readers: stream `PromptRecord`s from JSONL (a file or stdin) or Parquet (a file or a directory)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cbgen.errors import CbgenError
from cbgen.inputs.base import RESERVED_COLUMNS, Reader
from cbgen.inputs.jsonl import JsonlReader

__all__ = ["RESERVED_COLUMNS", "JsonlReader", "Reader", "open_reader"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def open_reader(path: str | Path, *, prompt_column: str | None = None, id_column: str | None = None,
                keep_columns: Sequence[str] = ()) -> Reader:
    """Open the reader that fits `path` ("-" is JSONL on stdin), checking up front what can be checked.

    Raises `CbgenError` for a missing, unreadable or unsupported file, a Parquet schema without the needed columns,
    or a kept column that would clash with an output column.
    """
    options = {"prompt_column": prompt_column, "id_column": id_column, "keep_columns": tuple(keep_columns)}
    if str(path) == "-":
        return JsonlReader(None, **options)
    local = Path(path)
    if not local.exists():
        raise CbgenError(f"input file '{path}' does not exist")
    name = local.name.lower()
    if name.removesuffix(".gz").endswith(JSONL_SUFFIXES):
        return JsonlReader(path, **options)
    if name.endswith(".parquet") or local.is_dir():
        from cbgen.inputs.parquet import ParquetReader  # pyarrow is slow to import; JSONL jobs do without it

        return ParquetReader(path, **options)
    raise CbgenError(f"cannot read '{path}': unsupported input format; use a .jsonl, .json or .ndjson file "
                     "(optionally .gz), a .parquet file or a directory of .parquet files, or - for JSONL on stdin")
