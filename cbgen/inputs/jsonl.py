"""JSON Lines input: one JSON object per line, from a file (optionally gzipped) or stdin.

Lines are read with a bound: a line longer than `max_line_bytes` is skipped in chunks, never held whole, and becomes
that row's error record. Any line that cannot be parsed (malformed, invalid UTF-8, nested too deeply for Python) is
an error record too; the file goes on.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple, Protocol

from cbgen.config.sections import MAX_LINE_BYTES
from cbgen.errors import CbgenError, RowError, describe_type
from cbgen.inputs.base import Reader, ReaderOptions
from cbgen.inputs.checks import check_id

if TYPE_CHECKING:
    from cbgen.inputs.scoring import ScoreFields
    from cbgen.render.templates import PromptTemplate

_CHUNK = 1 << 20


class TooLong(NamedTuple):
    """A line longer than the reader's limit, read past without being kept."""

    size: int


class _LineSource(Protocol):
    def readline(self, size: int = -1, /) -> bytes: ...


def bounded_lines(f: _LineSource, limit: int) -> Iterator[bytes | TooLong]:
    """The lines of a binary stream, each at most `limit` bytes (besides its newline) held at once; a longer line
    comes as TooLong(its size)."""
    while line := f.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        size = len(line)
        while chunk := f.readline(_CHUNK):
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
        yield TooLong(size)


def _decode(data: bytes, *, first: bool = False) -> Any:
    """One line's JSON value. Raises ValueError (also for invalid UTF-8) or RecursionError."""
    return json.loads(data.decode("utf-8-sig" if first else "utf-8"))


class JsonlReader(Reader):
    """Reads a JSONL file line by line; `path=None` reads stdin. Blank lines are skipped and not counted."""

    FORMAT = "jsonl"

    @classmethod
    def detect(cls, path: str, local: Path) -> tuple[str, str] | None:
        return (cls.FORMAT, "standard input is read as JSONL prompt rows") if path == "-" else None

    @classmethod
    def open(cls, path: str, options: ReaderOptions) -> Reader:
        options.no_dataset_options(path, cls.FORMAT)
        return cls(None if path == "-" else path, max_line_bytes=options.max_line_bytes or MAX_LINE_BYTES,
                   **options.rows())

    def __init__(self, path: str | Path | None, *, prompt_column: str | None = None, id_column: str | None = None,
                 keep_columns: Sequence[str] = (), detect_id: bool = True,
                 max_line_bytes: int = MAX_LINE_BYTES, template: PromptTemplate | None = None,
                 score: ScoreFields | None = None) -> None:
        super().__init__("<stdin>" if path is None else str(path), prompt_column=prompt_column,
                         id_column=id_column, keep_columns=keep_columns, detect_id=detect_id, template=template,
                         score=score)
        self.path = None if path is None else Path(path)
        self.max_line_bytes = max_line_bytes
        self._scanned: tuple[int, set[str]] | None = None  # (lines, settings named), see _scan
        self._stdin_head: list[tuple[int, bytes | TooLong]] = []  # stdin lines read ahead, replayed by _lines
        if self.path is not None:
            with self._open() as f:  # fail now, not mid-job, on a missing, unreadable or non-gzip file
                f.read(1)
        if self.detect_id:
            self._detect_id_column(list(self._first_object()))

    def _first_object(self) -> dict[str, Any]:
        """The first line that is a JSON object (read ahead on stdin), or {} when none is among the first lines."""
        lines = self._lines()
        try:
            for seen, (number, line) in enumerate(lines, 1):
                if self.path is None:
                    self._stdin_head.append((number, line))
                try:
                    row = None if isinstance(line, TooLong) else _decode(line, first=number == 1)
                except (ValueError, RecursionError):
                    row = None
                if isinstance(row, dict) or seen >= 64:
                    return row or {}
            return {}
        finally:
            lines.close()

    def _open(self) -> IO[bytes] | gzip.GzipFile:
        assert self.path is not None
        try:
            if self.path.name.lower().endswith(".gz"):
                f = gzip.open(self.path, "rb")
                try:
                    f.peek(1)  # gzip.open is lazy: read the header to check it
                except BaseException:
                    f.close()
                    raise
                return f
            return open(self.path, "rb")
        except FileNotFoundError:
            raise CbgenError(f"input file '{self.name}' does not exist") from None
        except IsADirectoryError:
            raise CbgenError(f"input file '{self.name}' is a directory, not a JSONL file") from None
        except PermissionError:
            raise CbgenError(f"cannot read input file '{self.name}': permission denied") from None
        except (gzip.BadGzipFile, EOFError):
            raise CbgenError(f"input file '{self.name}' is not a valid gzip file") from None

    def _lines(self) -> Generator[tuple[int, bytes | TooLong]]:
        """Yield `(line_number, line)` for the non-blank lines, counting from 1 over all physical lines."""
        if self.path is None:
            head, self._stdin_head = self._stdin_head, []
            yield from head
            start = head[-1][0] + 1 if head else 1
            lines = enumerate(bounded_lines(sys.stdin.buffer, self.max_line_bytes), start)
            yield from ((n, line) for n, line in lines if isinstance(line, TooLong) or line.strip())
            return
        try:
            with self._open() as f:
                lines = enumerate(bounded_lines(f, self.max_line_bytes), 1)
                yield from ((n, line) for n, line in lines if isinstance(line, TooLong) or line.strip())
        except (OSError, EOFError) as e:  # a truncated or corrupt gzip stream shows up only here
            # the lines before the cut are read (and run); the job says why it ended once they are written
            self.broken = f"cannot read input file '{self.name}' to its end: {e}"

    def objects(self) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
        """`(line_number, row, error)` for each non-blank line: its object, or why it is not one."""
        for n, line in self._lines():
            row, error = self._parse(n, line)
            yield n, row, error

    def _rows(self) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
        # stdin cannot be read twice to check its ids up front (check_ids): they are checked as the rows stream, and
        # a duplicate ends the job there, the rows before it written
        seen: dict[str, int] | None = {} if self.path is None and self.id_column is not None else None
        for n, row, error in self.objects():
            if seen is not None and row is not None:
                self._check_streamed_id(seen, row, n)
            yield f"{self.name}:{n}", row, error

    def _check_streamed_id(self, seen: dict[str, int], row: dict[str, Any], n: int) -> None:
        assert self.id_column is not None
        try:
            key = check_id(row.get(self.id_column), self.id_column)
        except RowError:
            return  # an error record when the row is read
        first = seen.setdefault(key, n)
        if first != n:
            raise CbgenError(f"{self.name}:{n}: duplicate id {key!r} (first seen on line {first}); the ids in field "
                             f"{self.id_column!r} must be unique: the rows before it are written; fix the feed and "
                             "rerun with --same-input to resume")

    def _parse(self, n: int, line: bytes | TooLong) -> tuple[dict[str, Any] | None, str | None]:
        """One line's object, or why it is not one."""
        if isinstance(line, TooLong):
            return None, (f"the line is {line.size:,} bytes long, more than --max-line-bytes "
                          f"({self.max_line_bytes:,}); raise it if such rows are meant")
        try:
            row = _decode(line, first=n == 1)
        except UnicodeDecodeError as e:
            return None, f"invalid UTF-8 at byte {e.start} of the line: {e.reason}"
        except json.JSONDecodeError as e:
            return None, f"invalid JSON: {e.msg} at column {e.colno}"
        except (ValueError, RecursionError) as e:
            return None, f"unreadable JSON: {e}"  # nested deeper than Python parses, numbers too long, ...
        if isinstance(row, dict):
            return row, None
        return None, f"expected a JSON object per line, got {describe_type(row)}"

    def _ids(self) -> Iterator[tuple[int, Any]]:
        for n, row, _ in self.objects():
            if row is not None and self.id_column is not None:  # unreadable rows: error records when read
                yield n, row.get(self.id_column)

    def _where(self, position: int, first: int) -> tuple[str, str]:
        return f"{self.name}:{position}", f"first seen on line {first}"

    def check_ids(self) -> None:
        """See `Reader.check_ids`; stdin cannot be read twice, so it is not checked."""
        if self.path is not None:
            super().check_ids()

    @property
    def settings_keys(self) -> tuple[str, ...]:
        return self.row_settings

    def settings_present(self) -> set[str] | None:
        """Row settings named anywhere in the file, by a byte search for each quoted key (a superset: a key quoted
        inside a string value is escaped, so only an odd case matches wrongly, and that only costs speed)."""
        return None if self.path is None else self._scan()[1]

    def count(self) -> int | None:
        """The number of non-blank lines, counted by streaming the file; None for stdin."""
        return None if self.path is None else self._scan()[0]

    def _scan(self) -> tuple[int, set[str]]:
        """One pass over the file for both the line count and the settings named in it, done once per reader."""
        if self._scanned is None:
            keys = {name: f'"{name}"'.encode() for name in self.settings_keys}
            lines, found = 0, set[str]()
            for _, line in self._lines():
                lines += 1
                if len(found) < len(keys) and not isinstance(line, TooLong):
                    found.update(name for name, key in keys.items() if name not in found and key in line)
            self._scanned = (lines, found)
        return self._scanned
