"""The reader base class: turns raw rows from any source into validated `PromptRecord`s.

Subclasses only say how raw rows are produced; ids, kept columns, prompt detection and validation live here so
every input format behaves the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cbgen.errors import CbgenError
from cbgen.records import PromptRecord

if TYPE_CHECKING:
    import pyarrow as pa

PROMPT_FIELDS = ("prompt", "messages", "input_ids")
ROLES = ("assistant", "developer", "system", "tool", "user")
# Names the output writers use for their own columns; a kept column with one of these names would be overwritten.
RESERVED_COLUMNS = frozenset(
    {"id", "sample_index", "text", "token_ids", "num_prompt_tokens", "num_generated_tokens", "finish_reason",
     "error", "logprobs"}
)


class RowError(ValueError):
    """A problem with one row: the row becomes an error record and reading goes on."""


class Reader(ABC):
    """A streaming source of `PromptRecord`s; iterate over it to read the rows in order."""

    def __init__(self, name: str, *, prompt_column: str | None, id_column: str | None,
                 keep_columns: Sequence[str]) -> None:
        reserved = [c for c in keep_columns if c in RESERVED_COLUMNS]
        if reserved:
            raise CbgenError(f"--keep-columns {reserved[0]!r} is a reserved output name; rename the column in "
                             f"{name!r} (reserved: {', '.join(sorted(RESERVED_COLUMNS))})")
        self._name = name
        # input fields that cannot apply, counted; `on_notice` is told each one the first time it appears
        self.notices: Counter[str] = Counter()
        self.on_notice: Callable[[str], None] | None = None
        self.prompt_column = prompt_column
        self.id_column = id_column
        self.keep_columns = tuple(dict.fromkeys(keep_columns))

    def _notice(self, message: str) -> None:
        self.notices[message] += 1
        if self.notices[message] == 1 and self.on_notice is not None:
            self.on_notice(message)

    @property
    def name(self) -> str:
        """A short display name of the source: the path as given, or "<stdin>"."""
        return self._name

    @property
    def kept_schema(self) -> pa.Schema | None:
        """The Arrow types of the kept columns where the source has a schema (Parquet), else None."""
        return None

    @abstractmethod
    def _rows(self) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
        """Yield `(location, row, error)` for each non-blank row; `row` is None when `error` says it is unreadable."""

    @abstractmethod
    def _ids(self) -> Iterator[tuple[int, Any]]:
        """Yield `(position, raw id)` for each readable row, reading as little as possible; see `_where`."""

    @abstractmethod
    def _where(self, position: int, first: int) -> tuple[str, str]:
        """Describe a duplicate: the location of `position` and a phrase for where `first` was seen."""

    @abstractmethod
    def count(self) -> int | None:
        """The number of rows, without materialising them; None when it cannot be known up front (stdin)."""

    def check_ids(self) -> None:
        """Raise `CbgenError` on the first duplicate id, so a job never writes two outputs under one id."""
        if self.id_column is None:
            return
        seen: dict[str, int] = {}
        for position, raw in self._ids():
            try:
                key = check_id(raw, self.id_column)
            except RowError:
                continue  # becomes an error record when the rows are read
            first = seen.setdefault(key, position)
            if first != position:
                location, earlier = self._where(position, first)
                raise CbgenError(f"{location}: duplicate id {key!r} ({earlier}); ids must be unique: "
                                 "fix the file, or drop --id-column to number rows")

    def __iter__(self) -> Iterator[PromptRecord]:
        for index, (location, row, error) in enumerate(self._rows()):
            if row is None:
                kept = dict.fromkeys(self.keep_columns)
                yield PromptRecord(id=str(index), index=index, location=location, kept=kept, error=error)
            else:
                yield self.to_record(row, index, location)

    def to_record(self, row: dict[str, Any], index: int, location: str) -> PromptRecord:
        """Turn one raw row into a record; any problem is recorded in `error` instead of raised."""
        record = PromptRecord(id=str(index), index=index, location=location,
                              kept={c: row.get(c) for c in self.keep_columns})
        try:
            if self.id_column is not None:
                record.id = check_id(row.get(self.id_column), self.id_column)
            field, value = self._find_prompt(row)
            if isinstance(value, list) and not value:
                raise RowError(f"{field!r} is an empty list")
            # The standard field names say what they hold; a --prompt-column is judged by its value.
            kind = field if self.prompt_column is None else _kind(value)
            if kind == "prompt" and isinstance(value, str):
                if not value.strip():
                    raise RowError(f"{field!r} is empty or whitespace only")
                record.prompt = value
            elif kind == "messages" and isinstance(value, list):
                record.messages = check_messages(field, value)
            elif kind == "input_ids" and isinstance(value, list):
                record.input_ids = check_input_ids(field, value)
            else:
                want = _EXPECTED.get(kind, "a string, a list of messages or a list of token ids")
                raise RowError(f"{field!r} must be {want}, got {describe_type(value)}")
            record.settings = self._settings(row)
        except RowError as e:
            record.error = str(e)
        return record

    def _settings(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row's own generation settings (temperature, top_p, top_k, max_new_tokens, stop)."""
        from cbgen.inputs.settings import parse_settings

        return parse_settings(row)

    def settings_present(self) -> set[str] | None:
        """Which row settings appear anywhere in the input, found cheaply before generation (the engine's samplers
        must exist from the start); None when that cannot be known up front (stdin), or a superset."""
        return None

    def _find_prompt(self, row: dict[str, Any]) -> tuple[str, Any]:
        if self.prompt_column is not None:
            if row.get(self.prompt_column) is None:
                raise RowError(f"the prompt field {self.prompt_column!r} is missing or null")
            return self.prompt_column, row[self.prompt_column]
        found = [f for f in PROMPT_FIELDS if row.get(f) is not None]
        if len(found) > 1:
            raise RowError(f"several prompt fields ({', '.join(found)}): keep one, or choose it with --prompt-column")
        if not found and any(f in row for f in PROMPT_FIELDS):
            raise RowError(f"the prompt field {next(f for f in PROMPT_FIELDS if f in row)!r} is null")
        if not found:
            keys = ", ".join(list(row)[:10]) + (", ..." if len(row) > 10 else "") or "none"
            raise RowError(f"no prompt field: expected one of prompt, messages, input_ids, the row has {keys}; "
                           "name the prompt field with --prompt-column")
        return found[0], row[found[0]]


def check_id(value: Any, column: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RowError(f"the id field {column!r} is missing, null or empty")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(f"the id field {column!r} must be a string or an integer, got {describe_type(value)}")
    return str(value)


_EXPECTED = {"prompt": "a string", "messages": "a list of messages", "input_ids": "a list of token ids"}


def _kind(value: Any) -> str | None:
    """Which prompt kind a --prompt-column value is; a list is judged by its first item so the check names bad ones."""
    if isinstance(value, str):
        return "prompt"
    if isinstance(value, list) and isinstance(value[0], dict):
        return "messages"
    if isinstance(value, list) and isinstance(value[0], int):
        return "input_ids"
    return None


def check_messages(field: str, messages: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"{field!r} message {i} must be an object with 'role' and 'content', "
                           f"got {describe_type(message)}")
        # Parquet structs carry every field on every row; a null there means the field is absent.
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role not in ROLES:
            got = "no role" if role is None else f"role {role!r}"
            raise RowError(f"{field!r} message {i} has {got}; expected one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), (str, list)):
            got = "no content" if "content" not in message else f"content that is {describe_type(message['content'])}"
            raise RowError(f"{field!r} message {i} has {got}; expected a string (or a list of parts)")
        out.append(message)
    return out


def check_input_ids(field: str, ids: list[Any]) -> list[int]:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise RowError(f"{field!r} must be a list of non-negative integers; item {i} is {t!r}")
    return ids


def describe_type(value: Any) -> str:
    """A JSON-ish name for the type of `value`, for row errors read by people who wrote JSON, not Python."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
