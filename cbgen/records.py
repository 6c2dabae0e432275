"""The small typed records that flow between the stages of a job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PromptRecord:
    """One input row as read from a file, before rendering.

    Exactly one of `prompt`, `messages` and `input_ids` is set, unless `error` says why the row cannot be used.
    """

    id: str
    index: int  # 0-based position in the input, also the default id
    location: str  # where the row came from, for messages: "prompts.jsonl:12" or "data.parquet row 11"
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    kept: dict[str, Any] = field(default_factory=dict)  # columns carried into the output (--keep-columns)
    error: str | None = None  # a row-level problem: the row becomes an error record, the job goes on
    # The row's own generation settings, validated (cbgen.inputs.settings.ROW_SETTINGS): temperature, top_p, top_k,
    # max_new_tokens, stop, n, logprobs. Unset ones take the job's value.
    settings: dict[str, Any] = field(default_factory=dict)
    raw: bool | None = None  # the row says how to tokenize its text (OpenAI completions: raw); None: the job decides
    endpoint: str | None = None  # OpenAI batch lines: "/v1/chat/completions" or "/v1/completions"
