"""What a row of a scoring job (cbgen score) gives to score, found and checked the same way for every reader.

    a row's `choices` (or the job's --choices)   each choice as a continuation of the row's prompt
    a row's completion field                      the completion as the continuation of the prompt
    a row's text field, and no prompt             the text on its own (perplexity)

The completion and text fields are named by --completion-column and --text-column; dots reach into nested values
(`answers.text`), as a pipeline's stages name their outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.errors import RowError, describe_type
from cbgen.kinds import kind_of
from cbgen.records import SCORE_RESERVED_NAMES, ScoreTarget

if TYPE_CHECKING:
    from cbgen.config import JobConfig

CHOICES_FIELD = "choices"
_MISSING = object()
MISSING = _MISSING  # what `lookup` returns for a path the row does not have


@dataclass(frozen=True)
class ScoreFields:
    """Where a scoring job finds what to score in its rows."""

    completion_column: str | None = "completion"  # None: a prompt is all a row gives (embed: the text itself)
    text_column: str = "text"
    choices: tuple[str, ...] | None = ()  # the job's own choices, for rows without theirs; None: no choices read
    completion_required: bool = True  # False: a row's prompt or messages may stand alone (reward: a conversation)
    reserved: frozenset[str] = SCORE_RESERVED_NAMES  # the output's own names, which a kept column may not take
    # the kind reads the whole row, whose prompt is optional (chat: its user turns, its simulated user's template):
    # a record carries the row as it was read
    whole_row: bool = False

    @classmethod
    def of(cls, job: JobConfig) -> ScoreFields | None:
        """The fields a job's rows give besides a prompt (its kind's `reads`); None for a generation job."""
        kind = kind_of(job.kind)
        section = getattr(job, kind.own_section) if kind.own_section else None
        return cls.of_kind(kind.name, dataclasses.asdict(section) if section is not None else {})

    @classmethod
    def of_kind(cls, name: str | None, section: Mapping[str, Any]) -> ScoreFields | None:
        """The fields of a job of kind `name` whose own settings section is `section` (as stored: a run
        directory's job); None for a kind whose rows give nothing but a prompt."""
        kind = kind_of(name)
        if not kind.reads:
            return None
        if kind.reads == ("row",):
            return cls(None, "", None, False, kind.reserved_names(), whole_row=True)
        return cls(section.get("completion_column", "completion") if "completion" in kind.reads else None,
                   section.get("text_column", "text"),
                   tuple(section.get("choices") or ()) if "choices" in kind.reads else None,
                   kind.completion_required, kind.reserved_names())

    @property
    def columns(self) -> tuple[str, ...]:
        """The top-level columns a columnar reader reads for them."""
        return (*((CHOICES_FIELD,) if self.choices is not None else ()),
                *((self.completion_column.split(".")[0],) if self.completion_column else ()),
                *((self.text_column.split(".")[0],) if self.text_column else ()))

    def text_of(self, row: Mapping[str, Any]) -> str | None:
        """The row's text to score on its own, when it has one (checked: a non-empty string)."""
        if not self.text_column:
            return None
        value = lookup(row, self.text_column)
        if value is _MISSING or value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise RowError(f"the text field {self.text_column!r} must be a non-empty string, got "
                           f"{describe_type(value) if not isinstance(value, str) else 'an empty one'}")
        return value

    def target(self, row: Mapping[str, Any]) -> ScoreTarget | None:
        """What to score after the row's prompt: its choices, the job's, or its completion; None where the prompt
        stands alone. Raises RowError naming what is wrong or missing."""
        if self.choices is not None:
            choices = row.get(CHOICES_FIELD)
            if choices is not None:
                return ScoreTarget(choices=_checked_choices(choices))
            if self.choices:
                return ScoreTarget(choices=self.choices)
        if self.completion_column is None:
            return None
        completion = lookup(row, self.completion_column)
        if (completion is _MISSING or completion is None) and not self.completion_required:
            return None
        if completion is _MISSING or completion is None:
            raise RowError(f"nothing to score: the row has a prompt but no {self.completion_column!r} field "
                           f"(--completion-column) and no {CHOICES_FIELD!r}, and the job gives no --choices")
        if not isinstance(completion, str):
            raise RowError(f"the completion field {self.completion_column!r} must be a string, got "
                           f"{describe_type(completion)}")
        if not completion:
            raise RowError(f"the completion field {self.completion_column!r} is empty: there is nothing to score")
        return ScoreTarget(completion=completion)


def lookup(row: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path of a row (`answers.text`), or _MISSING."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _checked_choices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise RowError(f"{CHOICES_FIELD!r} must be a non-empty list of strings, got {describe_type(value)}")
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            shown = "an empty string" if choice == "" else describe_type(choice)
            raise RowError(f"{CHOICES_FIELD!r} must be a list of non-empty strings; item {i} is {shown}")
    if len(set(value)) != len(value):
        raise RowError(f"{CHOICES_FIELD!r} holds the same string twice; each choice must be distinct")
    return tuple(value)
