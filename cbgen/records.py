"""The small typed records that flow between the stages of a job, and the fields of an output row.

    PromptRecord (read) -> Request (rendered, ordered) -> Completion (generated) -> output row (written)

The engine's names for a request's sequences live here too: the manager knows each sequence by an id made from
the request's key.

A request asking for the job's number of sequences is one manager request: its first sequence is the key itself and
transformers names the others `<key>__child#<k>` (k from 0, for sample index k + 1). A request asking for another
number runs as that many separate manager requests, which cbgen names `<key>~copy<j>` (sample index j). The engine
builds these ids, and the step control reads a sequence's sample index back from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cbgen.chat.formats import ResponseFormat


@dataclass(frozen=True, slots=True)
class ScoreTarget:
    """What a scoring job scores for one row (cbgen.score): exactly one of the three is set."""

    completion: str | None = None  # scored as the continuation of the row's prompt
    choices: tuple[str, ...] | None = None  # each scored as a continuation of the prompt, the prompt computed once
    text: str | None = None  # scored on its own: the row has no prompt


@dataclass(slots=True)
class PromptRecord:
    """One input row as read from a file, before rendering.

    Exactly one of `prompt`, `messages` and `input_ids` is set, unless `error` says why the row cannot be used, or
    the row of a scoring job is a text scored on its own (`target.text`).
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
    target: ScoreTarget | None = None  # what a scoring job scores (then a text-only row has no prompt)
    row: dict[str, Any] | None = None  # the row as read, for a kind that reads all of it (chat); else None
    model: str | None = None  # an OpenAI batch line's body.model: the job's adapter of that name answers it, if any


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
    min_tokens: int = 0  # stop strings count only where they end after this many tokens
    # the result cache (cbgen.result_cache): each sequence's key, and the sequences found there, when all were;
    # a request that arrives with `answered` set is yielded as it is by the engine (and the scorer), never run
    cache_keys: list[str] | None = None
    answered: list[Completion] | None = None
    uncut_length: int | None = None  # an encoding model's row: its tokens before the cut to the max length
    adapter: str | None = None  # the job's LoRA adapter its row names (cbgen.model.adapters); None: the job's own

    @property
    def ids(self) -> list[int]:
        """Its token ids: only asked of a request that can run (one without an error)."""
        if self.input_ids is None:
            raise ValueError(f"request {self.record.id!r} has no token ids ({self.error or 'not rendered'})")
        return self.input_ids


@dataclass(slots=True)
class Score:
    """What the scorer found for one row (cbgen.score): the scored tokens' logprobs, summed, or each choice's."""

    logprob: float | None = None  # the completion's (or text's) summed logprob; None for choices
    choice_logprobs: list[float] | None = None  # each choice's summed logprob, in the row's order
    choice_tokens: list[int] | None = None  # each choice's number of tokens


@dataclass(slots=True)
class Completion:
    """One returned sequence of a request (several per request with num_return_sequences > 1)."""

    request: Request
    sample_index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "repetition" (the loop stop) | "error"
    error: str | None = None
    text: str | None = None  # set when a stop string cut the text; else the tokens decode to it
    rejected: bool = False  # failed before reaching the engine: the request itself is bad (or too long)
    # per generated token, the most likely tokens of the model's own distribution: (token ids, logprobs)
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    score: Score | None = None  # a scoring job's result: then token_ids are the scored tokens (cbgen.score)
    # an embed job's embedding, a reward job's outputs (one per label): then token_ids are the tokens read
    vector: list[float] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the KV cache's shared prefixes, not computed

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens the engine took in: none for a request refused before admission. A text scored on its
        own (cbgen score) has one: its first token, the only one not scored."""
        if self.rejected:
            return 0
        target = self.request.record.target
        if target is not None and target.text is not None and self.score is not None:
            return 1
        return len(self.request.input_ids or [])


def requests_of(group: list[Completion]) -> list[Request]:
    """The distinct requests of a finished group's completions, in order: one for a request's sequences, one a turn
    for a conversation's."""
    return list({id(c.request): c.request for c in group}.values())


# One output row per returned sequence, with its keys in this order; `logprobs` follows when the job asked for
# logprobs, then the kept input columns.
BASE_FIELDS: tuple[str, ...] = (
    "id",
    "sample_index",
    "text",  # None when the request failed
    "token_ids",
    "num_prompt_tokens",
    "num_generated_tokens",
    "finish_reason",  # "stop" | "length" | "repetition" | "error"
    "error",  # None unless finish_reason is "error"
)
# One output row per scored input row (cbgen score), with its keys in this order; `token_ids`, `logprobs` and
# `top_logprobs` follow when the job asked for logprobs, then the kept input columns. Fields that do not apply to
# the row (choices for a completion, the summed logprob for choices) are null.
SCORE_FIELDS: tuple[str, ...] = (
    "id",
    "num_prompt_tokens",  # tokens before the scored ones: the prompt (a text's first token, which has no context)
    "num_scored_tokens",  # tokens scored: the completion's, the text's after its first, or all choices' together
    "logprob",  # the summed logprob of the completion or the text
    "mean_logprob",  # logprob / num_scored_tokens
    "perplexity",  # exp(-mean_logprob)
    "choices",  # the choices scored
    "choice_logprobs",  # each choice's summed logprob as a continuation of the prompt
    "choice_mean_logprobs",  # each choice's logprob per token
    "choice_probs",  # the choices' probabilities among themselves (a softmax of choice_logprobs)
    "best_choice",  # the choice with the highest summed logprob
    "error",  # None unless the row could not be scored
)
# Names the output rows use for their own fields: a kept input column may not take one of them.
RESERVED_NAMES: frozenset[str] = frozenset((*BASE_FIELDS, "logprobs", "top_logprobs", "reasoning", "tool_calls",
                                            "parsed"))
SCORE_RESERVED_NAMES: frozenset[str] = frozenset((*SCORE_FIELDS, "token_ids", "logprobs", "top_logprobs"))
# One output row per input row of an embed job (cbgen embed), then the kept input columns
EMBED_FIELDS: tuple[str, ...] = (
    "id",
    "embedding",  # float32, the model's dimension (None when the row failed)
    "num_tokens",  # tokens the model read (after truncation to its max length)
    "truncated",  # whether the text was longer than the model's max length and cut to it
    "error",
)
# One output row per input row of a reward job (kind: reward): its outputs (one column per label) come between
# num_tokens and error, then the kept input columns
REWARD_FIELDS: tuple[str, ...] = ("id", "num_tokens", "truncated", "error")


# One output row per input row of a chat job (kind: chat): a whole conversation, then the kept input columns
CHAT_FIELDS: tuple[str, ...] = (
    "id",
    "messages",  # the whole conversation: the row's opening, then every turn ({role, content})
    "num_turns",  # assistant replies
    "turns",  # per generated message (replies, a simulated user's messages): role, finish reason, token counts
    "num_prompt_tokens",  # over the turns: prompt tokens of every request
    "num_cached_tokens",  # of those, served from the KV cache's shared prefixes (an earlier turn's, mostly)
    "num_generated_tokens",  # over the turns
    "finish_reason",  # how the conversation ended: max_turns, user_turns, user_stop or error
    "error",  # None unless a turn failed
)


# The sequences of a request, as the engine names them (see the module's docstring)
CHILD_MARK = "__child#"  # transformers' suffix for a request's extra sequences
COPY_MARK = "~copy"  # cbgen's own suffix for the separate copies of a request


def sequence_ids(key: str, n: int, *, copies: bool) -> dict[str, int]:
    """The manager id of each of the request's `n` sequences, with its sample index."""
    if copies:
        return {f"{key}{COPY_MARK}{j}": j for j in range(n)}
    return {key: 0} | {f"{key}{CHILD_MARK}{k}": k + 1 for k in range(n - 1)}


def request_key(manager_id: str) -> str:
    """The key of the request a sequence belongs to."""
    return manager_id.partition(CHILD_MARK)[0].partition(COPY_MARK)[0]


def sample_index(manager_id: str) -> int:
    """A sequence's index among its request's sequences (the inverse of `sequence_ids`)."""
    key, child, k = manager_id.rpartition(CHILD_MARK)
    if child and key and k.isdigit():
        return int(k) + 1
    key, copy, j = manager_id.rpartition(COPY_MARK)
    if copy and key and j.isdigit():
        return int(j)
    return 0
