"""Parquet input: one file, or a directory of `*.parquet` files read in name order, streamed in batches."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from cbgen.errors import CbgenError, first_line
from cbgen.inputs.base import FROM_PATH, ID_FIELD, ColumnarReader

if TYPE_CHECKING:
    from cbgen.inputs.scoring import ScoreFields
    from cbgen.render.templates import PromptTemplate

BATCH_SIZE = 1024


class ParquetReader(ColumnarReader):
    """Reads only the needed columns, 1024 rows at a time; the columns are checked against every file's schema."""

    FORMAT = "parquet"

    @classmethod
    def detect(cls, path: str, local: Path) -> tuple[str, str] | None:
        return (cls.FORMAT, FROM_PATH) if local.is_file() and local.name.lower().endswith(".parquet") else None

    def __init__(self, path: str | Path, *, prompt_column: str | None = None, id_column: str | None = None,
                 keep_columns: Sequence[str] = (), detect_id: bool = True,
                 template: PromptTemplate | None = None, score: ScoreFields | None = None) -> None:
        super().__init__(str(path), prompt_column=prompt_column, id_column=id_column, keep_columns=keep_columns,
                         detect_id=detect_id, template=template, score=score)
        local = Path(path)
        self.files = sorted(str(f) for f in local.glob("*.parquet")) if local.is_dir() else [str(path)]
        if not self.files:
            raise CbgenError(f"input directory '{self.name}' contains no .parquet files")
        schemas = [_read_schema(file) for file in self.files]
        if all(ID_FIELD in schema.names for schema, _ in schemas):
            self._detect_id_column([ID_FIELD])
        # Per file: without --prompt-column one file may hold `prompt` and the next `messages`.
        self._columns = [self._resolve_columns(f"'{file}'", schema.names)
                         for file, (schema, _) in zip(self.files, schemas)]
        self._schema = schemas[0][0]
        self._starts = [0, *accumulate(n for _, n in schemas)]  # global position of each file's first row

    def settings_present(self) -> set[str]:
        """Row settings are columns: known from the schemas."""
        return {c for columns in self._columns for c in columns if c in self.row_settings}

    @property
    def schema(self) -> pa.Schema:
        """The (first) file's schema."""
        return self._schema

    @property
    def kept_schema(self) -> pa.Schema:
        """The kept columns as typed in the (first) file, so outputs can keep their Arrow types."""
        return pa.schema([self._schema.field(c) for c in self.keep_columns])

    def _batches(self, per_file: list[list[str]]) -> Iterator[tuple[str, pa.RecordBatch]]:
        """The batches of every file in turn, reading only `per_file[i]` from file i."""
        for file, columns in zip(self.files, per_file):
            try:
                with pq.ParquetFile(file) as f:
                    yield from ((file, batch) for batch in f.iter_batches(batch_size=BATCH_SIZE, columns=columns))
            except (pa.ArrowException, OSError) as e:
                raise CbgenError(f"cannot read input file '{file}': {first_line(e)}") from None

    def _rows(self) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
        file, n = None, 0
        for batch_file, batch in self._batches(self._columns):
            if batch_file != file:
                file, n = batch_file, 0
            for row in batch.to_pylist():
                n += 1
                yield f"{file} row {n}", row, None

    def _ids(self) -> Iterator[tuple[int, Any]]:
        assert self.id_column is not None
        position = 0
        for _, batch in self._batches([[self.id_column]] * len(self.files)):
            for value in batch.column(0).to_pylist():
                yield position, value
                position += 1

    def _locate(self, position: int) -> tuple[str, int]:
        i = bisect_right(self._starts, position) - 1
        return self.files[i], position - self._starts[i] + 1

    def _where(self, position: int, first: int) -> tuple[str, str]:
        (file, row), (first_file, first_row) = self._locate(position), self._locate(first)
        earlier = f"row {first_row}" if first_file == file else f"{first_file} row {first_row}"
        return f"{file} row {row}", f"first seen in {earlier}"

    def count(self) -> int:
        """The number of rows, from the files' metadata."""
        return self._starts[-1]


def _read_schema(file: str) -> tuple[pa.Schema, int]:
    """The Arrow schema and row count of `file`, from its footer only."""
    try:
        with pq.ParquetFile(file) as f:
            return f.schema_arrow, f.metadata.num_rows
    except FileNotFoundError:
        raise CbgenError(f"input file '{file}' does not exist") from None
    except PermissionError:
        raise CbgenError(f"cannot read input file '{file}': permission denied") from None
    except (pa.ArrowException, OSError) as e:
        raise CbgenError(f"input file '{file}' is not a valid Parquet file: {first_line(e)}") from None

