"""The small typed records that flow between the stages of a job, and the fields of an output row.

    PromptRecord (read) -> Request (rendered, ordered) -> Completion (generated) -> output row (written)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cbgen.formats import ResponseFormat


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
    tools: list[dict[str, Any]] | None = None  # functions offered to the model (OpenAI's `tools`), checked
    tool_choice: str = "none"  # "none" (tools not shown), "auto", "required", or the name of a forced function
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the row's own chat-template variables


@dataclass(slots=True)
class Request:
    """A record ready for the engine: its token ids, or the reason it cannot be generated."""

    record: PromptRecord
    input_ids: list[int] | None = None
    error: str | None = None
    max_new_tokens: int | None = None  # this request's own cap; None: the job's --max-new-tokens
    sampling: dict = field(default_factory=dict)  # per-request sampler settings (add_request's processor kwargs)
    stop: tuple[str, ...] = ()  # strings that end its sequences
    n: int | None = None  # its own number of sequences; None: the job's
    response_format: ResponseFormat | None = None  # the format its sequences follow
    top_logprobs: int = 0  # how many alternatives per token it wants (0: none)

    @property
    def ids(self) -> list[int]:
        """Its token ids: only asked of a request that can run (one without an error)."""
        if self.input_ids is None:
            raise ValueError(f"request {self.record.id!r} has no token ids ({self.error or 'not rendered'})")
        return self.input_ids


@dataclass(slots=True)
class Completion:
    """One returned sequence of a request (several per request with num_return_sequences > 1)."""

    request: Request
    sample_index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    text: str | None = None  # set when a stop string cut the text; else the tokens decode to it
    rejected: bool = False  # failed before reaching the engine: the request itself is bad (or too long)
    # per generated token, the most likely tokens of the model's own distribution: (token ids, logprobs)
    top_logprobs: list[tuple[list[int], list[float]]] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens the engine took in: none for a request refused before admission."""
        return 0 if self.rejected else len(self.request.input_ids or [])


# One output row per returned sequence, with its keys in this order; `logprobs` follows when the job asked for
# logprobs, then the kept input columns.
BASE_FIELDS: tuple[str, ...] = (
    "id",
    "sample_index",
    "text",  # None when the request failed
    "token_ids",
    "num_prompt_tokens",
    "num_generated_tokens",
    "finish_reason",  # "stop" | "length" | "error"
    "error",  # None unless finish_reason is "error"
)
# Names the output rows use for their own fields: a kept input column may not take one of them.
RESERVED_NAMES: frozenset[str] = frozenset((*BASE_FIELDS, "logprobs", "top_logprobs", "reasoning", "tool_calls",
                                            "parsed"))
