"""Rows into what an encoding model reads: token ids, cut to its max length.

    embed    a row's text (its text column), or its prompt (a prompt column or --template); never a chat template
    reward   a row's conversation in the model's chat template: its messages, or its prompt as the user's turn,
             with its completion (if any) as the assistant's answer; a text on its own is read as it is

A row that cannot be read (messages for an embedding, a conversation for a model without a chat template, token
ids) becomes a request with its error; the job goes on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from cbgen.encoders.load import LoadedEncoder
from cbgen.errors import first_line
from cbgen.records import PromptRecord, Request

TOKENIZE_BATCH = 256  # rows tokenized in one call of the fast tokenizer


class EncodeRenderer:
    """Turns records into requests for `loaded`, `template_kwargs` going to a reward model's chat template."""

    def __init__(self, loaded: LoadedEncoder, *, conversations: bool, template_kwargs: dict[str, Any] | None = None):
        self.loaded = loaded
        self.conversations = conversations  # reward: rows are conversations; embed: texts
        self.template_kwargs = template_kwargs or {}

    def render_all(self, records: Iterable[PromptRecord]) -> Iterator[Request]:
        it = iter(records)
        while chunk := list(islice(it, TOKENIZE_BATCH)):
            yield from self._render(chunk)

    def _render(self, records: list[PromptRecord]) -> list[Request]:
        requests = [Request(record, error=record.error) for record in records]
        texts: list[tuple[int, str, bool]] = []  # (position, text, add special tokens)
        for i, request in enumerate(requests):
            if request.error is not None:
                continue
            try:
                texts.append((i, *self._text(request.record)))
            except ValueError as e:
                request.error = f"{request.record.location}: {first_line(e, 300)}"
        loaded = self.loaded
        for special in (True, False):
            group = [(i, text) for i, text, s in texts if s is special]
            if not group:
                continue
            encoded = loaded.tokenizer([t.lower() if loaded.lowercase else t for _, t in group],
                                       add_special_tokens=special, truncation=False)["input_ids"]
            for (i, _), ids in zip(group, encoded):
                requests[i].input_ids = self._cut(list(ids), special)
                requests[i].uncut_length = len(ids)
        return requests

    def _cut(self, ids: list[int], special: bool) -> list[int]:
        """The ids cut to the max length as the tokenizer's own truncation cuts them: the special tokens that
        close the text are kept (a BERT text keeps its [SEP])."""
        limit = self.loaded.max_length
        if len(ids) <= limit:
            return ids
        closing = ids[-1:] if special and ids[-1] in self.loaded.tokenizer.all_special_ids else []
        return ids[: limit - len(closing)] + closing

    def _text(self, record: PromptRecord) -> tuple[str, bool]:
        """The row's text and whether the tokenizer adds its special tokens to it."""
        target = record.target
        if target is not None and target.text is not None:
            return target.text, True
        if record.input_ids is not None:
            raise ValueError("a row of token ids cannot be read by an encoding model: give it a text")
        if not self.conversations:
            if record.messages is not None:
                raise ValueError("an embedding reads a text, not messages: give the row a text field, or make "
                                 "one with --template")
            assert record.prompt is not None
            return record.prompt, True
        messages = list(record.messages) if record.messages is not None else [{"role": "user",
                                                                                 "content": record.prompt}]
        if target is not None and target.completion is not None:
            messages.append({"role": "assistant", "content": target.completion})
        tokenizer = self.loaded.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model has no chat template to read a conversation with: give the row a text "
                             "field instead")
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                 **(self.template_kwargs | record.template_kwargs))
        return rendered, False  # the template writes its own special tokens
