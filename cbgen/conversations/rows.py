"""A finished conversation as its output row (cbgen.records.CHAT_FIELDS, then the kept input columns)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from cbgen.conversations.state import Conversation

if TYPE_CHECKING:
    from cbgen.conversations.driver import Finished
    from cbgen.records import Completion
    from cbgen.rows.columns import OutputColumns


def message(entry: dict[str, Any]) -> dict[str, str]:
    """A message as the rows hold it: its role and its content as text (a list of parts as JSON)."""
    content = entry.get("content")
    return {"role": str(entry.get("role", "user")),
            "content": content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)}


def conversation_row(conversation: Conversation) -> dict[str, Any]:
    turns = conversation.turns
    return {
        "id": conversation.record.id,
        "messages": [message(m) for m in conversation.messages],
        "num_turns": conversation.replies,
        "turns": [turn.summary() for turn in turns],
        "num_prompt_tokens": sum(turn.num_prompt_tokens for turn in turns),
        "num_cached_tokens": sum(turn.num_cached_tokens for turn in turns),
        "num_generated_tokens": sum(len(turn.token_ids) for turn in turns),
        "finish_reason": conversation.ended,
        "error": conversation.error,
        **conversation.record.kept,
    }


class ChatRows:
    """What the writer stores of a finished conversation: one row with the job's `columns`."""

    def __init__(self, columns: OutputColumns) -> None:
        self.columns = columns

    def __call__(self, group: Finished | list[Completion]) -> list[dict[str, Any]]:
        conversation = getattr(group, "conversation", None)
        if conversation is None:  # a row refused before any model loaded (cbgen.job.run)
            conversation = Conversation(group[0].request.record).fail(group[0].error or "refused")
        return [conversation_row(conversation)]
