"""Rendering records into token ids, and ordering requests so that shared prefixes hit the KV cache."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cbgen.errors import first_line
from cbgen.records import PromptRecord, Request

LOOKAHEAD = 1024  # requests rendered ahead: the window of the prefix-aware order (and what sizes the KV cache)


def _text_length(content) -> int:
    """Characters in a message's content: a string, or a list of parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text") or "") if isinstance(part, dict) else len(str(part)) for part in content)
    return 0


def prefix_key(input_ids: list[int], key_tokens: int) -> tuple[int, ...] | None:
    """The prefix by which requests share KV blocks: the first `key_tokens` tokens (one KV page). None for a prompt
    that does not fill one: it has no complete block another request could reuse."""
    return tuple(input_ids[:key_tokens]) if len(input_ids) > key_tokens else None


@dataclass(frozen=True)
class RenderPlan:
    """How a job's records become token ids (cbgen.job.plan decides it from the job and the model)."""

    vocab_size: int
    raw_prompts: bool = False  # text as is, not as a user turn of the chat template
    max_positions: int | None = None  # the model's context
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the job's chat-template variables
    finds_calls: bool = False  # the model's response template can find tool calls in its replies


class Renderer:
    """Turns records into token ids with the tokenizer, as `plan` says: chat turns through the chat template (with
    the generation prompt), text as one user turn unless `raw_prompts` (or the tokenizer has no chat template), ids
    as given.

    With `max_positions` (the model's context), text that cannot fit is refused before it is tokenized: no token
    covers more characters than the longest one in the vocabulary, so a prompt longer than the context times that
    many characters has more tokens than the context holds, and tokenizing megabytes only to say so would cost
    seconds and gigabytes. Any failure while rendering one row is that row's error.
    """

    def __init__(self, tokenizer: Any, plan: RenderPlan) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = plan.template_kwargs  # a row's own chat-template variables go over these
        self.finds_calls = plan.finds_calls
        self.vocab_size = plan.vocab_size
        self.has_chat_template = getattr(tokenizer, "chat_template", None) is not None
        self.raw_prompts = plan.raw_prompts or not self.has_chat_template
        self.max_positions = plan.max_positions
        self._max_chars: int | None = None

    @property
    def max_chars(self) -> int | None:
        """The most characters a prompt that fits the context can have (None: no context known)."""
        if self.max_positions is None:
            return None
        if self._max_chars is None:
            longest = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
            self._max_chars = self.max_positions * max(longest, 1)
        return self._max_chars

    def render(self, record: PromptRecord) -> Request:
        if record.error is not None:
            return Request(record, error=record.error)
        try:
            return self._render(record)
        except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja errors, role-order checks), and
            # so may a tokenizer on odd text: it is the row's fault, never the job's
            return Request(record, error=f"cannot render the prompt: {first_line(e, 200)}")

    def _render(self, record: PromptRecord) -> Request:
        too_long = self._too_long(record)
        if too_long is not None:
            return Request(record, error=too_long)
        if record.input_ids is not None:
            ids = list(record.input_ids)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                return Request(record, error=f"input_ids: token id {bad} is outside the vocabulary "
                                             f"(size {self.vocab_size})")
        elif record.messages is not None:
            if not self.has_chat_template:
                return Request(record, error="the tokenizer has no chat template: give 'prompt' text or 'input_ids'")
            if record.tools and not self.finds_calls:
                return Request(record, error="the request offers tools, but the model has no response template to "
                                             "find tool calls in its reply; pass --response-template FILE "
                                             "(transformers' format) or leave the tools out")
            ids = self._chat(record.messages, record)
        else:
            ids = self._text(record.prompt or "", record.raw)
        if not ids:
            return Request(record, error="the prompt renders to zero tokens")
        return Request(record, input_ids=ids)

    def _too_long(self, record: PromptRecord) -> str | None:
        """Why the record's text cannot fit the context, told from its length alone; or None. (Token ids are
        checked against the context before admission, cbgen.engine.admission.)"""
        limit, positions = self.max_chars, self.max_positions
        if limit is None or positions is None or record.input_ids is not None:
            return None
        if record.messages is not None:
            length = sum(_text_length(m.get("content")) for m in record.messages)
        else:
            length = len(record.prompt or "")
        if length <= limit:
            return None
        return (f"prompt of {length:,} characters cannot fit the model's context of {positions:,} tokens "
                f"(no token covers more than {limit // positions} characters); shorten the prompt")

    def _chat(self, messages: list[dict], record: PromptRecord | None = None) -> list[int]:
        kwargs = self.template_kwargs
        tools = None
        if record is not None:
            kwargs = {**kwargs, **record.template_kwargs}
            tools = record.tools
            if tools or any("tool_calls" in m for m in messages):
                from cbgen.chat.tools import for_template

                messages = for_template(messages)
        encoded = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
        )
        return list(encoded["input_ids"])

    def _text(self, text: str, raw: bool | None = None) -> list[int]:
        if self.raw_prompts or raw:
            return list(self.tokenizer(text)["input_ids"])
        return self._chat([{"role": "user", "content": text}])

    def render_all(self, records: Iterable[PromptRecord]) -> Iterator[Request]:
        for record in records:
            yield self.render(record)


def prefix_aware_order(requests: Iterable[Request], *, key_tokens: int, lookahead: int,
                       default_max_new_tokens: int = 0) -> Iterator[Request]:
    """Reorders requests, `lookahead` at a time, so prefix sharing can work and long generations start first.

    The engine reuses a KV block only once a request has computed it: identical prefixes submitted together (as a
    sort would place them) all compute it themselves. So within each window of `lookahead` requests this yields one
    leader per distinct prefix (see `prefix_key`) first, then the followers grouped by prefix, sorted by
    their ids so that longer common prefixes sit together. Leaders asking for more new tokens go first (longest
    processing time first): a long generation admitted late would run on nearly alone at the end of the job, in
    small, inefficient batches. Failed requests are passed through first, at once. Every request is yielded exactly
    once.
    """
    buffer: list[Request] = []
    for request in requests:
        if request.input_ids is None:
            yield request
            continue
        buffer.append(request)
        if len(buffer) >= lookahead:
            yield from _leaders_then_followers(buffer, key_tokens, default_max_new_tokens)
            buffer = []
    yield from _leaders_then_followers(buffer, key_tokens, default_max_new_tokens)


def _leaders_then_followers(buffer: list[Request], key_tokens: int, default_cap: int) -> list[Request]:
    groups: dict[object, list[Request]] = {}
    for position, request in enumerate(buffer):
        key = prefix_key(request.ids, key_tokens)
        groups.setdefault(position if key is None else key, []).append(request)  # no prefix: a group of its own
    leaders, followers = [], []
    for members in groups.values():
        members.sort(key=lambda r: r.ids)
        leaders.append(members[0])
        followers.extend(members[1:])
    leaders.sort(key=lambda r: -(r.max_new_tokens or default_cap))  # stable: input order among equal caps
    return leaders + followers
