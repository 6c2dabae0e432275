"""A conversation's next turn as a request for the engine.

A reply's prompt is the conversation so far in the model's chat template, with the generation prompt. Earlier replies
are put back as the very tokens the model generated, not as their text tokenized again: the template is rendered
with a marker in place of each reply, the text between markers tokenized, and each reply's own tokens put in its
place. Turn k + 1's prompt then starts with exactly the tokens turn k computed (its prompt and its reply), so the
KV cache's shared blocks serve them and only the new user message is computed. Where the template changes a reply's
text (a template that strips whitespace or reasoning from earlier turns), the conversation is tokenized from its
text instead, as a generate job would.

A simulated user's prompt is its own: its system template and user template over the row's fields and `messages`,
the conversation so far.

Each turn's request carries a record of its own, `<id>#<k>` for the conversation's k-th generated turn (from 0): a
seeded turn's draws follow from it (cbgen.control.processor), the same in any batch and after a resume.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cbgen.conversations.state import ASSISTANT, USER, Conversation
from cbgen.errors import CbgenError, RowError, first_line
from cbgen.records import PromptRecord, Request

if TYPE_CHECKING:
    from cbgen.render.prompts import Renderer
    from cbgen.render.sandbox import Limits
    from cbgen.render.templates import PromptTemplate

_MARK = "\x00cbgen-reply-{}\x00"
_MARKS = re.compile("\x00cbgen-reply-(\\d+)\x00")


def simulated_user(chat: Any) -> PromptTemplate | None:
    """The simulated user's templates of a chat section (compiled: a syntax error is a CbgenError naming the
    setting, its line and column), or None when the user turns are listed."""
    from cbgen.render.templates import PromptTemplate

    return PromptTemplate.of(chat.user_template, chat.user_system, ("user_template", "user_system"))


def check_conversation_columns(job: Any, schema: Any) -> None:
    """A chat stage's input schema (a pyarrow.Schema), before the pipeline runs: the simulated user's templates parse
    and read columns the input has, and its user turns column is one of them."""
    user = simulated_user(job.chat)
    missing = sorted(v for v in (user.variables if user is not None else ()) if v not in {*schema.names, "messages"})
    if missing:
        raise CbgenError(f"user_template reads {missing[0]!r}, and its input has no such column; its columns are: "
                         f"{', '.join(schema.names)}")
    column = job.chat.user_turns_column
    if column is not None and column.split(".")[0] not in schema.names:
        raise CbgenError(f"user_turns_column {column!r}: its input has no such column; its columns are: "
                         f"{', '.join(schema.names)}")


def user_settings(chat: Any) -> dict[str, Any]:
    """The simulated user's own sampling, over the row's (row settings, as cbgen.inputs.settings names them)."""
    return {key: value for key, value in (("temperature", chat.user_temperature),
                                          ("max_new_tokens", chat.user_max_new_tokens)) if value is not None}


class TurnBuilder:
    """Builds each turn's request. `user`: the simulated user's templates (None: user turns are listed);
    `user_settings`: its own sampling (temperature, max_new_tokens) over the row's; `limits` and `stop`: its
    templates' rendering budget, and the job's stop."""

    def __init__(self, renderer: Renderer, user: PromptTemplate | None, user_settings: Mapping[str, Any],
                 limits: Limits | None = None, stop: threading.Event | None = None) -> None:
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.user = user
        self.user_settings = dict(user_settings)
        self.limits = limits
        self.stop = stop

    def request(self, conversation: Conversation, role: str) -> Request:
        """The request of `conversation`'s next turn, spoken by `role`. A failure is the request's error; a
        rendering stopped by the job's stop raises cbgen.render.sandbox.RenderStopped."""
        if role == ASSISTANT:
            return self._reply(conversation)
        return self._user(conversation)

    def record(self, conversation: Conversation, role: str, **prompt: Any) -> PromptRecord:
        """The record of `conversation`'s next turn, spoken by `role`, with the prompt given."""
        base = conversation.record
        settings = base.settings if role == ASSISTANT else {**base.settings, **self.user_settings}
        return PromptRecord(id=f"{base.id}#{len(conversation.turns)}", index=base.index, location=base.location,
                            settings=settings, template_kwargs=base.template_kwargs, **prompt)

    def _reply(self, conversation: Conversation) -> Request:
        ids = self._spelled(conversation) if conversation.spans else None
        if ids is not None:
            return self.renderer.render(self.record(conversation, ASSISTANT, input_ids=ids))
        return self.renderer.render(self.record(conversation, ASSISTANT, messages=conversation.messages))

    def _spelled(self, conversation: Conversation) -> list[int] | None:
        """The conversation's prompt with its earlier replies as their own tokens; None where the template does not
        keep a reply's text as it is."""
        messages, spans = conversation.messages, conversation.spans
        marked = [dict(m, content=_MARK.format(i)) if i in spans else m for i, m in enumerate(messages)]
        kwargs = {**self.renderer.template_kwargs, **conversation.record.template_kwargs}
        try:
            text = self.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True, **kwargs)
            real = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **kwargs)
        except Exception:  # noqa: BLE001 - the plain rendering says what is wrong, as the row's error
            return None
        pieces = _MARKS.split(text)
        between, replies = pieces[0::2], [int(i) for i in pieces[1::2]]
        if sorted(replies) != sorted(spans) or \
                between[0] + "".join(messages[i]["content"] + after for i, after in zip(replies, between[1:])) != real:
            return None
        ids = self._tokens(between[0])
        for i, after in zip(replies, between[1:]):
            ids += spans[i] + self._tokens(after)
        return ids

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _user(self, conversation: Conversation) -> Request:
        from cbgen.render.sandbox import RenderStopped

        assert self.user is not None
        fields = {**(conversation.record.row or {}), "messages": [dict(m) for m in conversation.messages]}
        try:
            turns = self.user.render(fields, self.limits, self.stop)
        except RowError as e:
            return Request(self.record(conversation, USER), error=f"the simulated user's template: {e}")
        except RenderStopped:
            raise
        except Exception as e:  # noqa: BLE001 - one row's values must not end the job
            return Request(self.record(conversation, USER), error=f"the simulated user's template failed: "
                                                                     f"{first_line(e, 200)}")
        assert isinstance(turns, list)
        return self.renderer.render(self.record(conversation, USER, messages=turns))
