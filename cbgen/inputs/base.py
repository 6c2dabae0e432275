"""The reader base class: turns raw rows from any source into validated `PromptRecord`s.

Subclasses only say how raw rows are produced; ids, kept columns, prompt detection and validation live here so
every input format behaves the same way.

Ids: `--id-column NAME` names the id field; without it, rows that carry an `id` field (or column) are known by it,
and rows that carry none by their position from 0 (`--id-column @row` asks for positions even when rows have ids).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.errors import CbgenError, RowError, describe_type, first_line
from cbgen.inputs.checks import ROW_NUMBER, check_id, check_input_ids, check_messages
from cbgen.inputs.scoring import MISSING, lookup
from cbgen.inputs.settings import ROW_SETTINGS, parse_settings
from cbgen.records import RESERVED_NAMES, PromptRecord, ScoreTarget

if TYPE_CHECKING:
    import threading

    import pyarrow as pa

    from cbgen.inputs.scoring import ScoreFields
    from cbgen.render.sandbox import Limits
    from cbgen.render.templates import PromptTemplate

@dataclass(frozen=True)
class IdChoice:
    """Where a job's request ids come from: a field of the rows, or their position (column None)."""

    column: str | None
    chosen_by: str  # "--id-column", "the rows' own id field", "row number", ...

    def to_dict(self) -> dict[str, Any]:
        return {"column": self.column, "chosen_by": self.chosen_by}


PROMPT_FIELDS = ("prompt", "messages", "input_ids")
ID_FIELD = "id"  # the field that names a row when --id-column does not


JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".ndjson", ".jsonl.gz", ".csv", ".arrow")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name: a hub dataset id, when no such local path exists
FROM_PATH = "recognised from the path"


@dataclass(frozen=True)
class ReaderOptions:
    """How a job reads its input, whatever the format: what a format's `Reader.open` is given (cbgen.inputs)."""

    prompt_column: str | None = None
    id_column: str | None = None
    keep_columns: tuple[str, ...] = ()
    detect_id: bool = True
    template: PromptTemplate | None = None
    score: ScoreFields | None = None
    split: str | None = None  # a Hugging Face dataset's (the other formats refuse it)
    subset: str | None = None
    max_line_bytes: int | None = None  # a JSONL line's cap (None: the reader's own default)

    def rows(self) -> dict[str, Any]:
        """What every reader's constructor takes: how rows become records."""
        return {"prompt_column": self.prompt_column, "id_column": self.id_column, "keep_columns": self.keep_columns,
                "detect_id": self.detect_id, "template": self.template, "score": self.score}

    def no_dataset_options(self, path: str, fmt: str) -> None:
        """Refuses --split and --subset for an input that is not read as a dataset."""
        if self.split or self.subset:
            raise CbgenError(f"--split and --subset apply to Hugging Face datasets, and '{path}' is read as {fmt}; "
                             "add --input-format dataset to read it with the datasets library")


class Reader(ABC):
    """A streaming source of `PromptRecord`s; iterate over it to read the rows in order.

    `detect_id`: when no id column is given, take the rows' own `id` field if they have one (subclasses call
    `_detect_id_column` once they know the fields). Off when resuming a run that numbered its rows.
    """

    def __init__(self, name: str, *, prompt_column: str | None, id_column: str | None,
                 keep_columns: Sequence[str], detect_id: bool = True, template: PromptTemplate | None = None,
                 score: ScoreFields | None = None) -> None:
        names = score.reserved if score is not None else RESERVED_NAMES
        reserved = [c for c in keep_columns if c in names]
        if reserved:
            raise CbgenError(f"--keep-columns {reserved[0]!r} is a reserved output name; rename the column in "
                             f"{name!r} (reserved: {', '.join(sorted(names))})")
        self._name = name
        # input fields that cannot apply, counted; `on_notice` is told each one the first time it appears
        self.notices: Counter[str] = Counter()
        self.on_notice: Callable[[str], None] | None = None
        self.detected = ""  # which format the input was read as, and why (open_reader)
        self.broken: str | None = None  # why the input ended before its end (a cut gzip stream): the rows before run
        self.prompt_column = prompt_column
        self.detect_id = detect_id and id_column is None
        self.id_column = None if id_column == ROW_NUMBER else id_column
        self.id_choice = "--id-column" if self.id_column else "row number"  # how the id column was chosen
        self.keep_columns = tuple(dict.fromkeys(keep_columns))
        if template is not None and prompt_column is not None:
            raise CbgenError("--prompt-column does not apply with --template: the template makes each row's prompt "
                             "from its columns; drop one of them")
        self.template = template  # the job's prompt templates: the prompt is made from the row's columns
        self.render_limits: Limits | None = None  # a row's rendering budget (cbgen.render.templates.render_limits)
        self.stop: threading.Event | None = None  # the job's: set, it ends a render in progress and the reading
        self.score = score  # a scoring job's rows: each also says what to score (cbgen.inputs.scoring)
        self.row_settings: tuple[str, ...] = ROW_SETTINGS  # a row's own settings (the job sets them: open_job_input)

    FORMAT = ""  # the name of the format it reads (--input-format)

    @classmethod
    def detect(cls, path: str, local: Path) -> tuple[str, str] | None:
        """The format that `path` (`local` as a path) is read as and why, where this reader's format tells it (a
        format may tell a look-alike's: the OpenAI batch sniff says JSONL rows too); None where it does not."""
        return None

    @classmethod
    def open(cls, path: str, options: ReaderOptions) -> Reader:
        """A reader of `path` with `options`, checked for this format (cbgen.inputs.open_reader)."""
        options.no_dataset_options(path, cls.FORMAT)
        return cls(path, **options.rows())

    def _detect_id_column(self, fields: Sequence[str]) -> None:
        """Takes the rows' `id` field as their id when no id column was given and the rows carry one."""
        if self.detect_id and ID_FIELD in fields:
            self.id_column, self.id_choice = ID_FIELD, "the rows' own id field"

    def _notice(self, message: str) -> None:
        self.notices[message] += 1
        if self.notices[message] == 1 and self.on_notice is not None:
            self.on_notice(message)

    @property
    def ids(self) -> IdChoice:
        """Where this reader's ids come from."""
        return IdChoice(self.id_column, self.id_choice)

    @property
    def name(self) -> str:
        """A short display name of the source: the path as given, or "<stdin>"."""
        return self._name

    @property
    def kept_schema(self) -> pa.Schema | None:
        """The Arrow types of the kept columns where the source has a schema (Parquet), else None."""
        return None

    @property
    def schema(self) -> pa.Schema | None:
        """Every column of the source with its Arrow type, where the source has a schema (Parquet, datasets); None
        for rows without one (JSONL)."""
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
                way_out = ("drop --id-column to number the rows" if self.id_choice == "--id-column"
                           else f"pass --id-column {ROW_NUMBER} to number the rows instead")
                raise CbgenError(f"{location}: duplicate id {key!r} ({earlier}); the ids in field {self.id_column!r} "
                                 f"must be unique: fix the file, or {way_out}")

    def __iter__(self) -> Iterator[PromptRecord]:
        from cbgen.render.sandbox import RenderStopped

        for index, (location, row, error) in enumerate(self._rows()):
            if self.stop is not None and self.stop.is_set():
                return  # the job is stopping: this row and the rest are for a resume
            if row is not None:
                try:
                    record = self.to_record(row, index, location)
                except RenderStopped:
                    return
                except Exception as e:  # noqa: BLE001 - whatever one row holds, it must not end the job
                    error = f"cannot read the row: {type(e).__name__}: {first_line(e, 200)}"
                else:
                    yield record
                    continue
            kept = dict.fromkeys(self.keep_columns)
            yield PromptRecord(id=str(index), index=index, location=location, kept=kept, error=error)

    def to_record(self, row: dict[str, Any], index: int, location: str) -> PromptRecord:
        """Turn one raw row into a record; any problem is recorded in `error` instead of raised."""
        record = PromptRecord(id=str(index), index=index, location=location,
                              kept={c: row.get(c) for c in self.keep_columns})
        try:
            if self.id_column is not None:
                record.id = check_id(row.get(self.id_column), self.id_column)
            if self.score is not None and self.score.whole_row:
                record.row = row
            if self.template is not None:
                self._templated(record, row)
                record.settings = parse_settings(row, keys=self.row_settings)
                if self.score is not None:
                    record.target = self.score.target(row)
                return record
            if self.score is not None and all(lookup(row, f) in (None, MISSING) for f in self._prompt_fields()):
                text = self.score.text_of(row)
                if text is not None:  # a text scored on its own
                    record.target = ScoreTarget(text=text)
                    return record
                if self.score.whole_row:  # no prompt: the kind finds its opening in the row (cbgen.conversations)
                    record.settings = parse_settings(row, keys=self.row_settings)
                    return record
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
                want = _EXPECTED.get(kind or "", "a string, a list of messages or a list of token ids")
                raise RowError(f"{field!r} must be {want}, got {describe_type(value)}")
            record.settings = parse_settings(row, keys=self.row_settings)
            if self.score is not None:
                record.target = self.score.target(row)
        except RowError as e:
            record.error = str(e)
        return record

    def _templated(self, record: PromptRecord, row: dict[str, Any]) -> None:
        """The record's prompt made from the row's columns by the job's templates."""
        assert self.template is not None
        rendered = self.template.render(row, self.render_limits, self.stop)
        if isinstance(rendered, str):
            if not rendered.strip():
                raise RowError("the template renders this row to an empty prompt")
            record.prompt = rendered
        else:
            if not any(turn["content"].strip() for turn in rendered):
                raise RowError("the templates render this row to empty turns")
            record.messages = rendered

    def settings_present(self) -> set[str] | None:
        """Which row settings appear anywhere in the input, found cheaply before generation (the engine's samplers
        must exist from the start); None when that cannot be known up front (stdin), or a superset."""
        return None

    def _prompt_fields(self) -> tuple[str, ...]:
        return (self.prompt_column,) if self.prompt_column is not None else PROMPT_FIELDS

    def _find_prompt(self, row: dict[str, Any]) -> tuple[str, Any]:
        if self.prompt_column is not None:
            value = lookup(row, self.prompt_column)  # dots reach into a nested value (an earlier stage's fields)
            if value is None or value is MISSING:
                raise RowError(f"the prompt field {self.prompt_column!r} is missing or null")
            return self.prompt_column, value
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


class ColumnarReader(Reader):
    """A reader of a source with named columns (Parquet, datasets): the columns are checked against its schema up
    front, and only those needed are read."""

    def _resolve_columns(self, where: str, names: Sequence[str]) -> list[str]:
        """The columns to read from a source with columns `names`, or a CbgenError naming the missing one and the
        columns there are. `where` names the source in messages ("'data.parquet'", "dataset 'x'")."""
        shown = ", ".join(names[:50]) + (f", ... ({len(names) - 50} more)" if len(names) > 50 else "")
        if self.score is not None and self.score.whole_row:  # every column: the kind reads the whole row
            prompt_columns = list(names)
        elif self.template is not None:
            missing = sorted(v for v in self.template.variables if v not in names)
            if missing:
                raise CbgenError(f"{where} has no column {missing[0]!r}, which the templates read; its columns are: "
                                 f"{shown}")
            prompt_columns = sorted(self.template.variables)
        elif self.prompt_column is not None:
            if self.prompt_column.split(".")[0] not in names:
                raise CbgenError(f"{where} has no column '{self.prompt_column}' (--prompt-column); its columns are: "
                                 f"{shown}")
            prompt_columns = [self.prompt_column.split(".")[0]]
        else:
            prompt_columns = [c for c in PROMPT_FIELDS if c in names]
            texts = self.score is not None and self.score.text_column.split(".")[0] in names
            if not prompt_columns and not texts:
                text = f", nor the text column {self.score.text_column!r}" if self.score is not None else ""
                raise CbgenError(f"{where} has none of the columns prompt, messages, input_ids{text}; its columns "
                                 f"are: {shown}; name the prompt column with --prompt-column"
                                 + (" or the text column with --text-column" if text else ""))
        for flag, columns in (("--id-column", [self.id_column] if self.id_column else []),
                              ("--keep-columns", self.keep_columns)):
            for column in columns:
                if column not in names:
                    raise CbgenError(f"{where} has no column '{column}' ({flag}); its columns are: {shown}")
        settings = [c for c in self.row_settings if c in names]  # the rows' own generation settings
        scored = [c for c in self.score.columns if c in names] if self.score is not None else []
        return list(dict.fromkeys([*prompt_columns, *([self.id_column] if self.id_column else []),
                                   *self.keep_columns, *settings, *scored]))


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
