"""OpenAI Batch API input: lines `{"custom_id", "method": "POST", "url", "body"}` for chat completions or completions.

A file made for OpenAI's batch service runs unchanged: `custom_id` is the id, the body's `messages` (chat, through
the model's chat template) or `prompt` (completions, tokenized as is) is the prompt, and the body's `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `n`, `stop` and `logprobs` become the row's own settings. Body
fields cbgen cannot honour are reported once each (`notices`), never silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cbgen.errors import RowError, describe_type
from cbgen.inputs.checks import check_id, check_input_ids, check_messages
from cbgen.inputs.jsonl import MAX_LINE_BYTES, JsonlReader
from cbgen.inputs.settings import CHECKS, parse_settings
from cbgen.openai_batch import COMPLETIONS, RequestLine
from cbgen.records import PromptRecord

# Body fields cbgen takes as they are meant, and those it accepts without effect (transport or bookkeeping).
HONOURED = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
            "logprobs", "top_logprobs", "seed", "response_format"}
NO_EFFECT = {"stream": "streaming does not apply to a batch", "user": "kept by OpenAI for abuse monitoring only",
             "metadata": "not used", "store": "not used"}
NOT_HONOURED = {
    "model": "cbgen answers with its --model",
}


def is_openai_batch_file(path: str | Path) -> bool:
    """Whether the first non-blank line of a JSONL file is an OpenAI batch request line."""
    reader = JsonlReader(path, detect_id=False)
    for n, line in reader._lines():
        row, _ = reader._parse(n, line)
        return RequestLine.matches(row)
    return False


class OpenAIBatchReader(JsonlReader):
    """Reads an OpenAI batch input file; ids are the `custom_id`s (checked unique up front)."""

    # body fields that shape the samplers, the count or the step control
    settings_keys = ("temperature", "top_p", "logprobs", "n", "top_logprobs", "seed", "response_format")

    def __init__(self, path: str | Path | None, *, keep_columns: Sequence[str] = (),
                 max_line_bytes: int = MAX_LINE_BYTES, **_: Any) -> None:
        super().__init__(path, id_column="custom_id", keep_columns=keep_columns, max_line_bytes=max_line_bytes)
        self.id_choice = "OpenAI batch lines' custom_id"

    def to_record(self, row: dict[str, Any], index: int, location: str) -> PromptRecord:
        record = PromptRecord(id=str(index), index=index, location=location,
                              kept={c: row.get(c) for c in self.keep_columns})
        try:
            record.id = check_id(row.get("custom_id"), "custom_id")
            line = RequestLine.parse(row)
            for key in line.extra:
                if key not in self.keep_columns:
                    self._notice(f"line field {key!r} is not part of an OpenAI batch request line and was ignored")
            record.endpoint = line.url
            if line.chat:
                self._chat_prompt(record, line.body)
            else:
                self._completion_prompt(record, line.body)
            record.settings = self._body_settings(line.body, line.url)
        except RowError as e:
            record.error = str(e)
        return record

    def _chat_prompt(self, record: PromptRecord, body: dict[str, Any]) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RowError(f"'body.messages' must be a non-empty list of messages, got {describe_type(messages)}")
        checked = check_messages("body.messages", messages)
        for i, message in enumerate(checked):
            if isinstance(message["content"], list):  # content parts: only text can reach a text model
                parts = message["content"]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in parts):
                    raise RowError(f"'body.messages' message {i} has non-text content parts; cbgen runs text models "
                                   "and takes only {'type': 'text', 'text': ...} parts")
                checked[i] = message | {"content": "".join(p["text"] for p in parts)}
        record.messages = checked
        record.raw = False

    def _completion_prompt(self, record: PromptRecord, body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise RowError("'body.prompt' is empty")
            record.prompt = prompt
            record.raw = True  # completions continue the text as given, without a chat template
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            record.input_ids = check_input_ids("body.prompt", prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise RowError("'body.prompt' holds several prompts; cbgen takes one prompt per line: split the line")
        else:
            raise RowError(f"'body.prompt' must be a string or a list of token ids, got {describe_type(prompt)}")

    def _body_settings(self, body: dict[str, Any], url: str) -> dict[str, Any]:
        for key in sorted(set(body) - HONOURED):
            if key in NO_EFFECT:
                continue
            if key in NOT_HONOURED:
                self._notice(f"body field {key!r} does not apply: {NOT_HONOURED[key]}")
            else:
                self._notice(f"body field {key!r} is not supported by cbgen and was ignored")
        taken = ("temperature", "top_p", "n", "stop", "seed", "response_format")
        values: dict[str, Any] = {k: body.get(k) for k in taken}
        names = {k: f"body.{k}" for k in taken}
        cap_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        values["max_new_tokens"] = body.get(cap_key)
        names["max_new_tokens"] = f"body.{cap_key}"
        logprobs, top = body.get("logprobs"), body.get("top_logprobs")
        if url == COMPLETIONS and isinstance(logprobs, int) and not isinstance(logprobs, bool):
            # the completions endpoint's logprobs is the number of alternatives per token (0: the chosen one only)
            logprobs, top = logprobs >= 0, logprobs if logprobs > 0 else None
            names["top_logprobs"] = "body.logprobs"
        else:
            names["top_logprobs"] = "body.top_logprobs"
        values["logprobs"], values["top_logprobs"] = logprobs, top
        names["logprobs"] = "body.logprobs"
        return parse_settings(values, names, keys=tuple(CHECKS))
