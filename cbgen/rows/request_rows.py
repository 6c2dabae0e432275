"""What the writer stores for a finished request: a row per returned sequence, or one OpenAI batch output line."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cbgen.chat.openai_batch import COMPLETIONS, Choice, OutputLine, stable_hex
from cbgen.config import JobConfig
from cbgen.records import Completion
from cbgen.rows.columns import JSON_KINDS, OutputColumns, wants_logprobs

if TYPE_CHECKING:
    from cbgen.chat.responses import Reply, ReplyParser


def parquet_parsed(columns: OutputColumns) -> Callable[[Any], Any]:
    """How a JSON value becomes what a Parquet shard's `parsed` column holds (cbgen.rows.parsed)."""
    from cbgen.rows.schema import parsed_type

    return parsed_type(columns).convert


def parsed(completion: Completion, text: str | None) -> Any:
    """The JSON value of an answer that had to be JSON and is complete; None when it was cut or failed, or the
    request asked for no JSON."""
    fmt = completion.request.response_format
    if fmt is None or fmt.kind not in JSON_KINDS or completion.finish_reason != "stop" or text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:  # a stop string cut it: then it is an error record already, but never claim it parsed
        return None


class OutputRows:
    """Turns a finished request's sequences into what the writer stores: rows with exactly the job's `columns`, or
    OpenAI batch output lines. `replies` splits chat replies into reasoning, tool calls and content (when the model
    has a response template); without a tokenizer (no model loaded: every request was refused) only error rows can
    be made."""

    def __init__(self, job: JobConfig, columns: OutputColumns, tokenizer: Any, model_name: str,
                 replies: ReplyParser | None = None) -> None:
        self.job = job
        self.columns = columns
        self.replies = replies
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._tokens: dict[int, str] = {}  # token id -> its text, for logprob listings
        # Parquet stores `parsed` in the Arrow type of the job's schema (JSON text where none holds): made here, so
        # that stored rows copied elsewhere (merge, input order) are never converted twice
        self._to_arrow = parquet_parsed(columns) if job.output.format == "parquet" and columns.parsed else None

    def __call__(self, group: list[Completion]) -> list[dict[str, Any]]:
        if self.job.output.format == "openai":
            return [self.openai_line(group).to_dict()]
        return [self.row(completion) for completion in group]

    def text(self, completion: Completion) -> str | None:
        if completion.finish_reason == "error":
            return None
        if completion.text is not None:
            return completion.text
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    def wants_logprobs(self, completion: Completion) -> bool:
        return wants_logprobs(self.job.generation, completion.request.record.settings)

    def top(self, completion: Completion) -> list[list[tuple[int, float]]] | None:
        """The k most likely tokens at each position, as the request asked for k; None when it did not."""
        k = completion.request.top_logprobs
        if not k or completion.top_logprobs is None:
            return None
        return [list(zip(ids[:k], values[:k])) for ids, values in completion.top_logprobs]

    def reply(self, completion: Completion) -> Reply | None:
        """The completion's reply split by the response template, when it applies (a chat request that offered
        tools, or any chat reply of a model that reasons); else None."""
        request = completion.request
        record = request.record
        plain_text = record.raw or (record.messages is None and self.job.input.raw_prompts)
        if self.replies is None or completion.finish_reason == "error" or record.endpoint == COMPLETIONS \
                or plain_text or not self.replies.applies(record.tools):
            return None
        call_id = stable_hex(record.id, str(completion.sample_index))
        return self.replies.parse(request.input_ids or [], completion.token_ids, record.tools, call_id)

    def token(self, token_id: int) -> str:
        text = self._tokens.get(token_id)
        if text is None:
            text = self._tokens[token_id] = self.tokenizer.decode([token_id])
        return text

    def row(self, completion: Completion) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": completion.request.record.id,
            "sample_index": completion.sample_index,
            "text": self.text(completion),
            "token_ids": completion.token_ids,
            "num_prompt_tokens": completion.num_prompt_tokens,
            "num_generated_tokens": len(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "error": completion.error,
        }
        if self.columns.logprobs:
            row["logprobs"] = (completion.logprobs or []) if self.wants_logprobs(completion) else None
        if self.columns.top_logprobs:
            top = self.top(completion)
            row["top_logprobs"] = [[{"token_id": t, "token": self.token(t), "logprob": v} for t, v in position]
                                   for position in top] if top is not None else None
        if self.columns.replies:
            reply = self.reply(completion)
            if reply is not None:
                row["text"] = reply.content
            row["reasoning"] = reply.reasoning if reply else None
            row["tool_calls"] = ([{"id": c["id"], **c["function"]} for c in reply.tool_calls]
                                 if reply and reply.tool_calls else None)
        if self.columns.parsed:
            value = parsed(completion, row["text"])
            row["parsed"] = self._to_arrow(value) if self._to_arrow is not None else value
        for name in self.columns.kept:
            row[name] = completion.request.record.kept.get(name)
        return row

    def openai_line(self, group: list[Completion]) -> OutputLine:
        first = group[0]
        record = first.request.record
        failed = next((c for c in group if c.finish_reason == "error"), None)
        if failed is not None:
            return OutputLine.failure(record.id, failed.error or "failed", input_error=failed.rejected)
        choices = []
        for completion in group:
            choice = Choice(self.text(completion), completion.token_ids, completion.finish_reason)
            reply = self.reply(completion)
            if reply is not None:
                choice.text, choice.reasoning, choice.tool_calls = reply.content, reply.reasoning, reply.tool_calls
            if self.wants_logprobs(completion) and completion.logprobs is not None:
                choice.logprobs = completion.logprobs
                choice.tokens = [self.token(t) for t in completion.token_ids]
                top = self.top(completion)
                if top is not None:
                    choice.top = [[(self.token(t), v) for t, v in position] for position in top]
            choices.append(choice)
        return OutputLine.success(record.id, record.endpoint, choices, model=self.model_name,
                                  prompt_tokens=first.num_prompt_tokens)
