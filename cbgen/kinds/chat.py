"""The chat kind (`kind: chat`): each input row grown into a conversation of several turns, one row per
conversation (cbgen.conversations). User turns come from a list in the row or from a simulated user (the same model,
prompted with a template over the row and the conversation so far)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cbgen.errors import CbgenError
from cbgen.kinds.base import Kind
from cbgen.progress import plural
from cbgen.records import CHAT_FIELDS

# generation settings a chat stage does not take, and why
NOT_TAKEN = {
    "num_return_sequences": "a conversation has one reply per turn (run the stage again with another seed for more)",
    "logprobs": "its rows hold messages, not tokens",
    "top_logprobs": "its rows hold messages, not tokens",
    **dict.fromkeys(("json_schema", "json_object", "regex", "choice", "grammar", "response_format"),
                    "its turns are free text (a later generate stage can format them)"),
}


class Chat(Kind):
    name = "chat"
    own_section = "chat"
    card_title = "Conversations by cbgen"
    card_verb = "grown into conversations"
    card_settings = "chat"
    runner = "conversations"
    reads = ("row",)  # its user turns and its simulated user's template read any field of the row
    unit = "conversation"
    meanings = {
        "messages": "the whole conversation: the row's opening, then each turn as {role, content}",
        "num_turns": "assistant replies in the conversation",
        "turns": "each generated message in order (assistant replies and simulated user messages): its role, "
                 "finish reason and token counts",
        "num_prompt_tokens": "prompt tokens over every turn's request",
        "num_cached_tokens": "of those, served from the KV cache's shared prefixes (an earlier turn's) instead of "
                             "computed",
        "num_generated_tokens": "tokens generated over every turn",
        "finish_reason": "how the conversation ended: max_turns, user_turns (its listed turns ran out), user_stop "
                         "(the simulated user's message matched user_stop) or error",
        "error": "why a turn failed (the conversation ends there, its turns so far kept), else null",
    }

    def setting_error(self, section: str, key: str, own_sections: frozenset[str]) -> str | None:
        if section == "generation" and key in NOT_TAKEN:
            return f"{key!r} does not apply to a chat stage: {NOT_TAKEN[key]}"
        return super().setting_error(section, key, own_sections)

    def check(self, job: Any) -> None:
        chat = job.chat
        if (chat.user_turns_column is None) == (chat.user_template is None):
            raise CbgenError("a chat stage takes its user turns from one place: give user_turns_column (a list "
                             "field of the row) or user_template (a simulated user), not both or neither")
        simulated = ("user_system", "user_stop", "user_temperature", "user_max_new_tokens")
        given = [key for key in simulated if getattr(chat, key) is not None]
        if chat.user_template is None and given:
            raise CbgenError(f"{given[0]} applies to the simulated user: give user_template, or drop {given[0]}")
        g = job.generation
        default = type(g)()
        taken = [key for key in NOT_TAKEN if getattr(g, key) != getattr(default, key)]
        if taken:
            raise CbgenError(f"{taken[0]} does not apply to a chat stage: {NOT_TAKEN[taken[0]]}")
        if job.run.data_parallel > 1:
            raise CbgenError("a chat stage runs in one engine (each turn waits on the one before): drop "
                             "--data-parallel, and split a large input with --num-shards instead")
        if job.output.format == "openai":
            raise CbgenError("--output-format openai holds single answers, not conversations: use jsonl or parquet")
        if "length" in job.run.redo:
            raise CbgenError("--redo length does not apply to a chat stage (a turn cut by the token cap does not "
                             "end its conversation): use --redo failed")

    def column_names(self, columns: Any) -> tuple[str, ...]:
        return (*CHAT_FIELDS, *columns.kept)

    def reserved_names(self) -> frozenset[str]:
        return frozenset(CHAT_FIELDS)

    def identifies(self, columns: set[str] | frozenset[str]) -> bool:
        return "num_turns" in columns

    def fingerprint(self, job: Any, fingerprint: dict[str, Any]) -> dict[str, Any]:
        return fingerprint | {"kind": self.name, "chat": dataclasses.asdict(job.chat)}

    def redo_kinds(self, kinds: list[str]) -> list[str]:
        return [k for k in kinds if k != "length"]

    def counts(self, summary: Any) -> dict[str, int]:
        return {"conversations": summary.requests, "failed": summary.failed_requests,
                "turns": summary.run_sequences, "prompt_tokens": summary.prompt_tokens,
                "cached_prompt_tokens": summary.cached_prompt_tokens, "generated_tokens": summary.generated_tokens,
                "resumed_conversations": summary.resumed_requests, "loop_stopped": summary.loop_stopped}

    def rows_counted(self, counts: Mapping[str, Any]) -> Any:
        return counts.get("conversations", "?")

    def summary_rows(self, summary: Any, duration: Any, cache_line: Any) -> list[tuple[str, str]]:
        throughput = summary.throughput()
        computed = summary.run_prompt_tokens - summary.cached_prompt_tokens
        return [
            ("model", str(summary.model)),
            ("conversations / failed", f"{summary.requests} / {summary.failed_requests}"),
            ("turns generated", f"{summary.run_sequences:,} (this run)"),
            ("prompt tokens: computed / from cache", f"{computed:,} / {summary.cached_prompt_tokens:,} "
                                                     "(this run; an earlier turn's KV served again)"),
            ("generated tokens", f"{summary.generated_tokens:,}"),
            ("generated tokens/s", f"{throughput['generated_tokens_per_s']:,.1f}"),
            self.timings_row(summary, duration, "generation"),
            *([("ended by the loop stop", plural(summary.loop_stopped, "turn"))] if summary.loop_stopped else []),
            ("result cache", cache_line(summary.result_cache)),
            self.output_row(summary),
        ]
