"""A conversation's state: the messages so far, the turns generated, and what comes next.

A conversation opens with its row's messages (or its prompt as a user turn; nothing, when its user turns open it).
Then, until it ends: a reply when the last message is the user's; else, below max_turns replies, the next user turn,
from the row's list (inserted as it is) or from the simulated user (generated). It ends after max_turns replies, when
its listed user turns run out, when the simulated user's message matches user_stop (that message left out), or when
a turn fails. Every step is a function of the row and the turns before it, so replaying the journal's turns
(cbgen.conversations.journal) rebuilds a resumed conversation exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from cbgen.errors import RowError, describe_type
from cbgen.inputs.scoring import MISSING, lookup
from cbgen.records import PromptRecord

ASSISTANT, USER = "assistant", "user"


@dataclass
class Turn:
    """One generated message: a reply, or a simulated user's message."""

    role: str
    content: str
    token_ids: list[int]  # as generated (a reply's end-of-sequence token included)
    finish_reason: str  # the sequence's: stop, length, repetition or error
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # the tokens that spell `content` exactly (the reply without its end token), when they do: the next turn's
    # prompt holds these very tokens, so that its prefix is the one this turn computed
    spelled: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens, "error": self.error, "spelled": self.spelled}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Turn:
        return cls(data["role"], data["content"], list(data["token_ids"]), data["finish_reason"],
                   int(data.get("num_prompt_tokens") or 0), int(data.get("num_cached_tokens") or 0),
                   data.get("error"), data.get("spelled"))

    def summary(self) -> dict[str, Any]:
        """What the output row's `turns` holds of it."""
        return {"role": self.role, "finish_reason": self.finish_reason, "num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens, "num_generated_tokens": len(self.token_ids)}


@dataclass(frozen=True)
class Rules:
    """How conversations go on (the job's chat section, checked)."""

    max_turns: int
    listed_column: str | None  # user turns from this list field of the row
    simulated: bool  # user turns from the simulated user
    user_stop: re.Pattern[str] | None = None

    @classmethod
    def of(cls, chat: Any) -> Rules:
        return cls(chat.max_turns, chat.user_turns_column, chat.user_template is not None,
                   re.compile(chat.user_stop) if chat.user_stop else None)


@dataclass
class Conversation:
    record: PromptRecord
    messages: list[dict[str, Any]] = field(default_factory=list)
    listed: list[str] | None = None  # the row's user turns still to come (None: the simulated user writes them)
    turns: list[Turn] = field(default_factory=list)
    spans: dict[int, list[int]] = field(default_factory=dict)  # message index -> the reply's own tokens
    ended: str | None = None  # how it ended: max_turns, user_turns, user_stop or error
    error: str | None = None

    @classmethod
    def open(cls, record: PromptRecord, rules: Rules) -> Conversation:
        """The conversation a row opens; a row that cannot open one is a conversation ended by its error."""
        conversation = cls(record)
        if record.error is not None:
            return conversation.fail(record.error)
        if record.messages is not None:
            conversation.messages = [dict(m) for m in record.messages]
        elif record.prompt is not None:
            conversation.messages = [{"role": USER, "content": record.prompt}]
        try:
            if rules.listed_column is not None:
                conversation.listed = _listed(record.row or {}, rules.listed_column)
            if not conversation.messages and not conversation.listed and not rules.simulated:
                raise RowError(f"nothing opens the conversation: the row has no prompt or messages, and its "
                               f"{rules.listed_column!r} list is empty")
        except RowError as e:
            return conversation.fail(str(e))
        return conversation

    def fail(self, error: str) -> Conversation:
        self.ended, self.error = "error", error
        return self

    @property
    def replies(self) -> int:
        return sum(turn.role == ASSISTANT for turn in self.turns)

    def next_role(self, rules: Rules) -> str | None:
        """Who speaks next (ASSISTANT or USER, the simulated user), inserting the row's next listed user turn when
        it is that one's; None once the conversation has ended (then `ended` says how)."""
        if self.ended is not None:
            return None
        if self.messages and self.messages[-1].get("role") == USER:
            return ASSISTANT
        if self.listed is not None and not self.listed:
            self.ended = "user_turns"
            return None
        if self.replies >= rules.max_turns:
            self.ended = "max_turns"
            return None
        if self.listed is not None:
            self.messages.append({"role": USER, "content": self.listed.pop(0)})
            return ASSISTANT
        return USER

    def add(self, turn: Turn, rules: Rules) -> None:
        """A finished turn: its message joins the conversation, or it ends it (a failure; user_stop)."""
        self.turns.append(turn)
        if turn.finish_reason == "error":
            self.fail(turn.error or "the turn failed")
            return
        if turn.role == USER and rules.user_stop is not None and rules.user_stop.search(turn.content):
            self.ended = "user_stop"
            return
        if turn.spelled is not None:
            self.spans[len(self.messages)] = turn.spelled
        self.messages.append({"role": turn.role, "content": turn.content})


def _listed(row: dict[str, Any], column: str) -> list[str]:
    value = lookup(row, column)
    if not isinstance(value, list):
        shown = "nothing (the row has no such field)" if value is MISSING or value is None else describe_type(value)
        raise RowError(f"the user turns field {column!r} (user_turns_column) must be a list of strings, got {shown}")
    for i, turn in enumerate(value):
        if not isinstance(turn, str) or not turn.strip():
            shown = "an empty string" if isinstance(turn, str) else describe_type(turn)
            raise RowError(f"the user turns field {column!r} must hold non-empty strings; item {i} is {shown}")
    return list(value)
