"""What a row of a scoring job (cbgen score) gives to score, found and checked the same way for every reader.

    a row's `choices` (or the job's --choices)   each choice as a continuation of the row's prompt
    a row's completion field                      the completion as the continuation of the prompt
    a row's text field, and no prompt             the text on its own (perplexity)

The completion and text fields are named by --completion-column and --text-column; dots reach into nested values
(`answers.text`), as a pipeline's stages name their outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.errors import RowError, describe_type
from cbgen.kinds import kind_of
from cbgen.records import ScoreTarget

if TYPE_CHECKING:
    from cbgen.config import JobConfig

CHOICES_FIELD = "choices"
_MISSING = object()


@dataclass(frozen=True)
class ScoreFields:
    """Where a scoring job finds what to score in its rows."""

    completion_column: str = "completion"
    text_column: str = "text"
    choices: tuple[str, ...] = ()  # the job's own choices, for rows without theirs

    @classmethod
    def of(cls, job: JobConfig) -> ScoreFields | None:
        """The fields of a scoring job; None for a generation job."""
        if not kind_of(job.kind).takes_section("score"):
            return None
        s = job.score
        return cls(s.completion_column, s.text_column, tuple(s.choices))

    @property
    def columns(self) -> tuple[str, ...]:
        """The top-level columns a columnar reader reads for them."""
        return (CHOICES_FIELD, self.completion_column.split(".")[0], self.text_column.split(".")[0])

    def text_of(self, row: Mapping[str, Any]) -> str | None:
        """The row's text to score on its own, when it has one (checked: a non-empty string)."""
        value = lookup(row, self.text_column)
        if value is _MISSING or value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise RowError(f"the text field {self.text_column!r} must be a non-empty string, got "
                           f"{describe_type(value) if not isinstance(value, str) else 'an empty one'}")
        return value

    def target(self, row: Mapping[str, Any]) -> ScoreTarget:
        """What to score after the row's prompt: its choices, the job's, or its completion. Raises RowError naming
        what is wrong or missing."""
        choices = row.get(CHOICES_FIELD)
        if choices is not None:
            return ScoreTarget(choices=_checked_choices(choices))
        if self.choices:
            return ScoreTarget(choices=self.choices)
        completion = lookup(row, self.completion_column)
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
