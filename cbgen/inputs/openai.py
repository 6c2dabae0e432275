"""OpenAI Batch API input: lines `{"custom_id", "method": "POST", "url", "body"}` for chat completions or completions.

A file made for OpenAI's batch service runs unchanged: `custom_id` is the id, the body's `messages` (chat, through
the model's chat template) or `prompt` (completions, tokenized as is) is the prompt, and the body's `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `n`, `stop`, `logprobs`, `presence_penalty`, `frequency_penalty`
and `logit_bias` (and vLLM's `top_k`, `repetition_penalty`, `min_p`, `min_tokens`, `bad_words`, `ignore_eos`) become
the row's own settings. A line whose body asks for what cbgen cannot honour (`best_of`, audio, an unknown field) is
refused, its error record saying why: answering it without would answer another request than the one asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cbgen.chat.formats import tool_call_format
from cbgen.chat.openai_batch import COMPLETIONS, RequestLine
from cbgen.chat.tools import check_tool_choice, check_tools
from cbgen.errors import CbgenError, RowError, describe_type
from cbgen.inputs.base import JSONL_SUFFIXES, Reader, ReaderOptions
from cbgen.inputs.checks import check_id, check_input_ids, check_messages
from cbgen.inputs.jsonl import MAX_LINE_BYTES, JsonlReader
from cbgen.inputs.settings import CHECKS, CONTROL_SETTINGS, parse_settings
from cbgen.records import PromptRecord

# Body fields cbgen takes as they are meant, and those it accepts without effect (transport or bookkeeping).
HONOURED = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
            "logprobs", "top_logprobs", "seed", "response_format", "tools", "tool_choice", "reasoning_effort",
            "chat_template_kwargs", "presence_penalty", "frequency_penalty", "logit_bias",
            # vLLM's extensions of the same body
            "repetition_penalty", "min_p", "min_tokens", "ignore_eos", "top_k", "bad_words"}
NO_EFFECT = {"stream": "streaming does not apply to a batch", "user": "kept by OpenAI for abuse monitoring only",
             "metadata": "not used", "store": "not used", "parallel_tool_calls": "not used",
             "stream_options": "streaming does not apply to a batch", "service_tier": "not used",
             "prompt_cache_key": "cbgen shares prefixes on its own", "safety_identifier": "not used",
             "prediction": "a latency hint: the answer is the same without it"}
NOT_HONOURED = {
    "model": "cbgen answers with its --model (or the job's adapter of that name: --adapter NAME=PATH)",
}
# Body fields that change the answer and that cbgen cannot honour: a line asking for one is refused (its error record
# says why) rather than answered as another request. Each with the values that ask for nothing (accepted).
REFUSED: dict[str, tuple[str, tuple]] = {
    "best_of": ("cbgen returns every sequence it generates: set n instead", (None, 1)),
    "audio": ("cbgen runs text models", (None,)),
    "modalities": ("cbgen runs text models and writes text only", (None, ["text"])),
    "functions": ("the old spelling of tools: give 'tools' (and 'tool_choice') instead", (None, [])),
    "function_call": ("the old spelling of tool_choice: give 'tool_choice' instead", (None, "none", "auto")),
    "web_search_options": ("cbgen has no web search", (None,)),
    "verbosity": ("cbgen's models have no verbosity switch", (None,)),
    "use_beam_search": ("cbgen has no beam search", (None, False)),
    "length_penalty": ("it applies to beam search, which cbgen has not", (None, 1, 1.0)),
}


DETECTION_LINES = 64  # lines that parse, read to tell an OpenAI batch file from plain rows
PROMPT_KEYS = ("prompt", "messages", "input_ids")


def detect_openai_batch(path: str | Path) -> tuple[bool, str]:
    """Whether a JSONL file holds OpenAI batch request lines, and why: decided from the first lines that parse
    (not from line 1 alone, which may be the one bad line). It does when more of them carry a request line's keys
    (custom_id, method, url, body) than a plain row's prompt field, and at least one is a whole request line."""
    reader = JsonlReader(path, detect_id=False)
    parsed = request_like = whole = plain = 0
    for _, row, error in reader.objects():
        if error is not None or not isinstance(row, dict):
            continue
        parsed += 1
        request_like += any(key in row for key in RequestLine.KEYS)
        whole += RequestLine.matches(row)
        plain += any(key in row for key in PROMPT_KEYS)
        if parsed == DETECTION_LINES:
            break
    counts = (f"{request_like} of the first {parsed} lines that parse carry OpenAI request-line keys "
              f"(custom_id, method, url, body), {plain} a prompt, messages or input_ids field")
    if whole and request_like > plain:
        return True, f"read as OpenAI batch lines: {counts}"
    return False, f"read as prompt rows: {counts}"


class OpenAIBatchReader(JsonlReader):
    """Reads an OpenAI batch input file; ids are the `custom_id`s (checked unique up front)."""

    FORMAT = "openai"

    @classmethod
    def detect(cls, path: str, local: Path) -> tuple[str, str] | None:
        """A JSONL file (.gz too): OpenAI batch lines or prompt rows, as its first lines tell."""
        if not (local.is_file() and local.name.lower().removesuffix(".gz").endswith(JSONL_SUFFIXES)):
            return None
        openai, why = detect_openai_batch(local)
        return (cls.FORMAT if openai else JsonlReader.FORMAT), why

    @classmethod
    def open(cls, path: str, options: ReaderOptions) -> Reader:
        if options.score is not None:
            raise CbgenError("an OpenAI batch file holds requests to generate, not texts to score: give cbgen score "
                             "JSONL, Parquet or a dataset")
        if options.prompt_column or options.id_column or options.template is not None:
            raise CbgenError("--prompt-column, --id-column and templates do not apply to an OpenAI batch file: its "
                             "lines carry body.messages or body.prompt, and custom_id")
        options.no_dataset_options(path, cls.FORMAT)
        return cls(None if path == "-" else path, keep_columns=options.keep_columns,
                   max_line_bytes=options.max_line_bytes or MAX_LINE_BYTES)

    # body fields that shape the samplers, the count or the step control
    settings_keys = ("temperature", "top_p", "logprobs", "n", "top_logprobs", "seed", "response_format",
                     "tool_choice", "top_k", *CONTROL_SETTINGS)

    def settings_present(self) -> set[str] | None:
        found = super().settings_present()
        if found is not None and "tool_choice" in found:  # a required call is a format
            found = (found - {"tool_choice"}) | {"response_format"}
        return found

    def __init__(self, path: str | Path | None, *, keep_columns: Sequence[str] = (),
                 max_line_bytes: int = MAX_LINE_BYTES, **_: Any) -> None:
        super().__init__(path, id_column="custom_id", keep_columns=keep_columns, max_line_bytes=max_line_bytes)
        self.id_choice = "OpenAI batch lines' custom_id"

    def to_record(self, row: dict[str, Any], index: int, location: str) -> PromptRecord:
        record = PromptRecord(id=str(index), index=index, location=location,
                              kept={c: row.get(c) for c in self.keep_columns})
        try:
            if "custom_id" in row:  # first, so that an error about the rest of the line carries it
                record.id = check_id(row["custom_id"], "custom_id")
            line = RequestLine.parse(row)
            for key in line.extra:
                if key not in self.keep_columns:
                    self._notice(f"line field {key!r} is not part of an OpenAI batch request line and was ignored")
            record.endpoint = line.url
            if line.chat:
                self._chat_prompt(record, line.body)
                self._chat_extras(record, line.body)
            else:
                self._completion_prompt(record, line.body)
            record.settings = self._body_settings(line.body, line.url)
            model = line.body.get("model")
            record.model = model if isinstance(model, str) else None
            if record.tool_choice not in ("none", "auto"):  # a required call: generation follows its grammar
                if "response_format" in record.settings:
                    raise RowError("'body.response_format' and a required tool call ('body.tool_choice') each set "
                                   "the reply's format: give one")
                name = None if record.tool_choice == "required" else record.tool_choice
                record.settings["response_format"] = tool_call_format(record.tools or [], name)
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

    def _chat_extras(self, record: PromptRecord, body: dict[str, Any]) -> None:
        """Tools and chat-template variables (a reasoning model's switches, `reasoning_effort`)."""
        tools = check_tools(body["tools"]) if body.get("tools") is not None else None
        record.tool_choice = check_tool_choice(body.get("tool_choice"), tools)
        record.tools = tools if record.tool_choice != "none" else None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RowError(f"'body.chat_template_kwargs' must be an object, got {describe_type(kwargs)}")
        if body.get("reasoning_effort") is not None:
            effort = body["reasoning_effort"]
            if effort not in ("minimal", "low", "medium", "high"):
                raise RowError(f"'body.reasoning_effort' must be minimal, low, medium or high, got {effort!r}")
            kwargs = {"reasoning_effort": effort, **kwargs}
        record.template_kwargs = kwargs

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
                continue
            why, neutral = REFUSED.get(key, (None, (None,)))
            if key == "best_of" and body[key] == body.get("n"):  # best of n out of n: all of them
                continue
            if body[key] in neutral:
                continue
            raise RowError(f"body field {key!r} cannot be honoured ({why or 'cbgen does not know it'}); the line "
                           "is refused rather than answered as another request: remove the field")
        taken = ("temperature", "top_p", "top_k", "n", "stop", "seed", "response_format", *CONTROL_SETTINGS)
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
