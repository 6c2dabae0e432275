"""Write output rows into numbered shards that appear under their final name only once complete.

A crash or a full disk therefore never leaves a truncated `part-*.jsonl`/`part-*.parquet` behind: every shard a
later resume or merge finds is whole, and a half-written one is at most a hidden `.part-*.tmp` file.
"""

from __future__ import annotations

import errno
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from cbgen.errors import CbgenError
from cbgen.files import fsync_directory
from cbgen.rows.columns import OutputColumns

if TYPE_CHECKING:  # pyarrow is slow to import: JSONL jobs, `cbgen status` and `cbgen merge` of JSONL do without it
    import pyarrow as pa
    import pyarrow.parquet as pq

_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class ShardWriter(ABC):
    """Streams rows into shards of `rows_per_shard` rows, committing each one atomically when full.

    Use it as a context manager: leaving the block normally commits the last, partial shard; leaving it with an
    exception drops that shard instead. After any error while writing the writer is aborted and cannot be reused.
    `rows_written` counts rows in committed shards only.
    """

    suffix: ClassVar[str]

    def __init__(
        self,
        directory: Path,
        *,
        rows_per_shard: int = 10_000,
        columns: OutputColumns | None = None,
        kept_schema: pa.Schema | None = None,
        first_shard: int = 0,
    ) -> None:
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be at least 1, got {rows_per_shard}")
        columns = columns or OutputColumns()
        clashes = sorted(columns.reserved.intersection(columns.kept))
        if clashes:
            raise CbgenError(
                f"kept column '{clashes[0]}' clashes with an output field of the same name; "
                "rename it in the input or leave it out of --keep-columns"
            )
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        except OSError as e:
            raise CbgenError(
                f"output directory '{self.directory}' is not writable: {e.strerror or e}; choose another with -o"
            ) from e
        self.rows_per_shard = rows_per_shard
        self.columns = columns  # the rows' columns (JSONL rows carry them already; Parquet keeps exactly these)
        self.kept_schema = kept_schema
        self.rows_written = 0
        self._next_index = first_shard
        self._shards: list[Path] = []
        self._file: IO[bytes] | None = None  # the open temporary shard
        self._rows_in_shard = 0
        self._closed = False

    @property
    def shards(self) -> list[Path]:
        """Committed shards, in order."""
        return list(self._shards)

    def write(self, row: dict[str, Any]) -> None:
        """Add one row to the open shard, committing the shard when it is full."""
        self.write_group([row])

    def write_group(self, rows: Sequence[dict[str, Any]]) -> None:
        """Add rows that belong together (the sequences of one request) to the same shard, then commit the shard
        if it is full: a resume then finds a request either whole or not at all."""
        if self._closed:
            raise ValueError("write() on a closed shard writer")
        with self._guard():
            if self._file is None:
                self._file = open(self._temp_path(), "wb")
            for row in rows:
                self._write_row(row)
        self._rows_in_shard += len(rows)
        if self._rows_in_shard >= self.rows_per_shard:
            self._commit()

    @property
    def pending_rows(self) -> int:
        """Rows written to the open shard but not committed yet."""
        return self._rows_in_shard

    def commit(self) -> None:
        """Commit the open shard now, however few rows it holds (a time-based checkpoint)."""
        if self._file is not None and not self._closed:
            self._commit()

    def close(self) -> None:
        """Commit the last, partial shard, if it holds any row."""
        if self._closed:
            return
        if self._file is not None:
            self._commit()
        self._closed = True

    def abort(self) -> None:
        """Drop the open shard without committing it; committed shards stay."""
        self._closed = True
        if self._file is None:
            return
        with suppress(Exception):  # the file is thrown away: failing to tidy it up (disk full, say) does not matter
            self._discard()
        with suppress(OSError):
            self._file.close()
        self._file = None
        self._rows_in_shard = 0
        self._temp_path().unlink(missing_ok=True)  # already gone if it was renamed

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _final_path(self) -> Path:
        return self.directory / f"part-{self._next_index:05d}.{self.suffix}"

    def _temp_path(self) -> Path:
        return self.directory / f".part-{self._next_index:05d}.{self.suffix}.tmp"

    def _commit(self) -> None:
        assert self._file is not None
        final = self._final_path()
        with self._guard():
            self._finish()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._temp_path(), final)
            try:
                fsync_directory(self.directory)
            except BaseException:
                final.unlink(missing_ok=True)  # not reported as committed, so not left behind either
                raise
        self._file = None
        self._shards.append(final)
        self.rows_written += self._rows_in_shard
        self._rows_in_shard = 0
        self._next_index += 1

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Abort on any failure, so no temporary shard outlives it; a full disk becomes a CbgenError."""
        try:
            yield
        except BaseException as e:
            final = self._final_path()
            self.abort()
            if isinstance(e, OSError) and e.errno in _DISK_FULL:
                raise CbgenError(
                    f"disk full while writing '{final}': free some space or choose another directory with -o"
                ) from e
            raise

    # The format-specific part: the base class owns naming, rotation, fsync, rename and counting.
    @abstractmethod
    def _write_row(self, row: dict[str, Any]) -> None:
        """Add one row to the current shard, whose temporary file `self._file` is open."""

    @abstractmethod
    def _finish(self) -> None:
        """Write whatever the current shard still holds back; the base class then flushes and closes the file."""

    def _discard(self) -> None:
        """Forget the current shard's state; its file is about to be deleted."""


class JsonlShardWriter(ShardWriter):
    """`part-NNNNN.jsonl`: one UTF-8 JSON object per line, keys in row order."""

    suffix = "jsonl"

    def _write_row(self, row: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(_json_text(row).encode("utf-8") + b"\n")

    def _finish(self) -> None:
        pass


class ParquetShardWriter(ShardWriter):
    """`part-NNNNN.parquet`, written a row group of at most ROW_GROUP rows at a time so memory stays bounded.

    Kept columns missing from `kept_schema` get their types from the first row group ever written (see
    `infer_kept_schema`); that schema then holds for every later shard, so all shards share one schema.
    """

    suffix = "parquet"
    ROW_GROUP = 1000

    def __init__(self, directory: Path, **kwargs: Any) -> None:
        from cbgen.rows.schema import arrow_schema

        super().__init__(directory, **kwargs)
        self.schema: pa.Schema | None = arrow_schema(self.columns, self.kept_schema)
        self._buffer: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None

    def _write_row(self, row: dict[str, Any]) -> None:
        self._buffer.append(row)
        if len(self._buffer) >= self.ROW_GROUP:
            self._flush_buffer()

    def _finish(self) -> None:
        self._flush_buffer()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _discard(self) -> None:
        self._buffer = []
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()  # else its finaliser would write a footer into a closed file

    def _flush_buffer(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from cbgen.rows.schema import arrow_schema, infer_kept_schema

        if not self._buffer:
            return
        if self.schema is None:
            kept = self.columns.kept
            known = [f for f in self.kept_schema or [] if f.name in kept]
            unknown = [n for n in kept if not any(f.name == n for f in known)]
            inferred = infer_kept_schema(self._buffer, unknown)
            self.schema = arrow_schema(self.columns, pa.schema([*known, *inferred]))
            assert self.schema is not None
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._file, self.schema)
        self._writer.write_table(self._to_table(self._buffer), row_group_size=self.ROW_GROUP)
        self._buffer = []

    def _to_table(self, rows: list[dict[str, Any]]) -> pa.Table:
        import pyarrow as pa

        assert self.schema is not None
        columns = []
        for field in self.schema:
            values = [row.get(field.name) for row in rows]
            if field.name in self.columns.kept and pa.types.is_string(field.type):
                values = [v if v is None or isinstance(v, str) else _json_text(v) for v in values]
            try:
                columns.append(pa.array(values, type=field.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                if field.name not in self.columns.kept:
                    raise
                raise CbgenError(
                    f"kept column '{field.name}' does not fit the type {field.type} of its first values while "
                    f"writing '{self._final_path()}' ({e}); make the column's values one type or write JSONL"
                ) from e
        return pa.Table.from_arrays(columns, schema=self.schema)


def open_writer(fmt: str, directory: Path, **kwargs: Any) -> ShardWriter:
    """The shard writer for output format `fmt`: "jsonl" or "parquet" (a row per sequence), or "openai" (JSONL
    with one OpenAI Batch API output line per request, built by cbgen.chat.openai_batch)."""
    writers: dict[str, type[ShardWriter]] = {"jsonl": JsonlShardWriter, "parquet": ParquetShardWriter,
                                             "openai": JsonlShardWriter}
    if fmt == "openai" and (kwargs.get("columns") or OutputColumns()).kept:
        raise CbgenError("--keep-columns does not apply to --output-format openai: its lines have OpenAI's "
                         "fixed shape, and their custom_id links each one to its input line")
    if fmt not in writers:
        raise CbgenError(f"unknown output format '{fmt}'; use one of: {', '.join(writers)}")
    return writers[fmt](directory, **kwargs)


def _json_default(value: Any) -> Any:
    """Values JSON has no type for (dates and times from Parquet input, say) are written as text."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=_json_default)
