"""From a scoring job's records to what the scorer runs: the context's token ids and each continuation's.

The prompt (or messages) is rendered exactly as `cbgen run` renders it, the generation prompt included, so a
completion is scored as the model's reply to that prompt. A completion or choice is tokenized on its own, without
special tokens, and follows the prompt's ids; a text scored on its own is tokenized as the tokenizer does by
default (its BOS token, if it adds one) and every token after its first is scored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from cbgen.errors import first_line
from cbgen.records import PromptRecord, Request
from cbgen.render.prompts import Renderer


@dataclass(slots=True)
class ScoreRequest:
    """One row, ready to score: `request.input_ids` is the context, then come the continuations scored after it (a
    completion, or the choices); with none, the context itself is scored from its second token (a text)."""

    request: Request  # with input_ids the context, or an error
    continuations: tuple[tuple[int, ...], ...] = ()

    @property
    def error(self) -> str | None:
        return self.request.error

    @property
    def context(self) -> list[int]:
        return self.request.ids

    @property
    def has_choices(self) -> bool:
        """The continuations are choices (else: one completion, or none for a text)."""
        target = self.request.record.target
        return target is not None and target.choices is not None

    @property
    def scores_context(self) -> bool:
        """A text scored on its own: its tokens are the scored ones."""
        return not self.continuations

    @property
    def length(self) -> int:
        """Tokens of the row laid out for one forward pass: the context and every continuation side by side."""
        return len(self.context) + sum(map(len, self.continuations))

    @property
    def longest(self) -> int:
        """Positions the longest sequence of the row reaches: the context and its longest continuation."""
        return len(self.context) + max(map(len, self.continuations), default=0)


class ScoreRenderer:
    """Turns a scoring job's records into ScoreRequests with the job's Renderer (chat template, raw prompts) and
    the tokenizer; any problem with one row is that row's error, never the job's."""

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.max_positions = renderer.max_positions

    def render(self, record: PromptRecord) -> ScoreRequest:
        target = record.target
        if record.error is not None or target is None:
            return ScoreRequest(Request(record, error=record.error or "nothing to score"))
        try:
            if target.text is not None:
                return self._text(record, target.text)
            request = self.renderer.render(record)
            if request.error is not None:
                return ScoreRequest(request)
            texts = target.choices if target.choices is not None else (target.completion or "",)
            what = "choice" if target.choices is not None else "completion"
            continuations = tuple(self._continuation(text) for text in texts)
            empty = next((i for i, ids in enumerate(continuations) if not ids), None)
            if empty is not None:
                shown = f" {empty} ({texts[empty]!r})" if target.choices is not None else ""
                return self._refused(record, f"the {what}{shown} tokenizes to zero tokens: there is nothing to score")
            scored = ScoreRequest(request, continuations)
            if self.max_positions is not None and scored.longest > self.max_positions:
                return self._refused(record, f"the prompt and its {what} take {scored.longest:,} tokens, more than "
                                             f"the model's context of {self.max_positions:,}; shorten them")
            return scored
        except Exception as e:  # noqa: BLE001 - a tokenizer may raise anything on odd text: the row's fault
            return self._refused(record, f"cannot tokenize the row: {first_line(e, 200)}")

    def render_all(self, records: Iterable[PromptRecord]) -> Iterator[ScoreRequest]:
        for record in records:
            yield self.render(record)

    def _text(self, record: PromptRecord, text: str) -> ScoreRequest:
        limit = self.renderer.max_chars
        if limit is not None and len(text) > limit:
            return self._refused(record, f"the text of {len(text):,} characters cannot fit the model's context of "
                                         f"{self.max_positions:,} tokens; shorten it or split it")
        ids = list(self.tokenizer(text)["input_ids"])
        if self.max_positions is not None and len(ids) > self.max_positions:
            return self._refused(record, f"the text is {len(ids):,} tokens, longer than the model's context of "
                                         f"{self.max_positions:,}; shorten it or split it")
        if len(ids) < 2:
            return self._refused(record, "the text is a single token: there is nothing to score it against")
        return ScoreRequest(Request(record, input_ids=ids))

    def _continuation(self, text: str) -> tuple[int, ...]:
        encoded: Any = self.tokenizer(text, add_special_tokens=False)
        return tuple(encoded["input_ids"])

    @staticmethod
    def _refused(record: PromptRecord, why: str) -> ScoreRequest:
        return ScoreRequest(Request(record, error=why))
