"""Controls over each sequence's own history, applied inside the decoding step: penalties, n-gram bans, logit bias,
min_p, a floor on the length (min_tokens, ignore_eos) and the loop stop.

transformers' continuous batching cannot carry these: its history-dependent processors see only the current token
of a request, and unsupported ones are dropped. cbgen's step control (cbgen.control.processor) knows each sequence
by its manager id, so it keeps the history here, incrementally (a token per step), and applies every control to the
rows that ask for it, row by row, so a sequence's scores never depend on its batch-mates' settings.

Order, the same as transformers' `generate` builds its processors (vLLM applies the same ones, in an order that
differs only where two of them meet on one token):
    1. logit_bias (OpenAI: added to the logits)
    2. repetition_penalty (transformers/vLLM: over prompt and generated tokens; a positive logit divided, a negative
       one multiplied)
    3. presence_penalty and frequency_penalty (OpenAI: over generated tokens, logit - count * frequency - presence)
    4. no_repeat_ngram_size (an n-gram of prompt and generated tokens never occurs twice), then bad_words
       (cbgen.control.bad_words: token sequences and text never generated)
    5. min_tokens and ignore_eos (end-of-sequence tokens masked until then / always)
    6. transformers' temperature, top-k and top-p
    7. min_p (tokens below min_p times the most likely one's probability removed), then the draw or the argmax.
The loop stop looks at the generated tokens after each step: once they end with one span repeated `loop_stop`
times, the next step can only end the sequence, and its finish reason is "repetition".
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from cbgen.control.bad_words import BadWord, BadWords

CONTROLS_KWARG = "controls"  # a request's Controls (Controls.key), as a processor kwarg

# The settings this module honours, each with its neutral value (the value that changes nothing).
NEUTRAL: dict[str, Any] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                           "no_repeat_ngram_size": 0, "min_p": 0.0, "min_tokens": 0, "logit_bias": {},
                           "bad_words": [], "ignore_eos": False, "loop_stop": 0, "loop_stop_span": 32}


@dataclass(frozen=True)
class Controls:
    """One request's history controls (the job's, with the row's own over them)."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[BadWord, ...] = ()  # strings (banned as text) and token-id sequences
    ignore_eos: bool = False
    loop_stop: int = 0  # end once the generated tokens end with one span repeated this many times (0: off)
    loop_stop_span: int = 32  # the longest span the loop stop looks for, in tokens

    @classmethod
    def of(cls, values: dict[str, Any]) -> Controls:
        bias = values.get("logit_bias") or {}
        fields = {k: v for k, v in values.items()
                  if k in NEUTRAL and k not in ("logit_bias", "bad_words") and v is not None}
        return cls(**fields, logit_bias=tuple(sorted((int(k), float(v)) for k, v in bias.items())),
                   bad_words=_bad_words(values.get("bad_words") or ()))

    @property
    def active(self) -> bool:
        return self != Controls(loop_stop_span=self.loop_stop_span)

    def key(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_key(cls, key: str) -> Controls:
        data = json.loads(key)
        data["logit_bias"] = tuple((int(t), float(b)) for t, b in data["logit_bias"])
        data["bad_words"] = _bad_words(data["bad_words"])
        return cls(**data)


def _bad_words(words) -> tuple[BadWord, ...]:
    """Bad words in one order, each once: strings as they are, token-id sequences as tuples."""
    unique = {w if isinstance(w, str) else tuple(int(t) for t in w) for w in words}
    return tuple(sorted(unique, key=lambda w: (isinstance(w, str), str(w))))


@dataclass
class History:
    """What the controls need of one sequence's tokens, kept up to date a step at a time."""

    controls: Controls
    prompt_length: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt and generated
    seen: set[int] = field(default_factory=set)  # every token id of prompt and generated (repetition_penalty)
    seen_order: list[int] = field(default_factory=list)  # the same ids, in the order first seen
    counts: Counter = field(default_factory=Counter)  # generated tokens (presence and frequency penalties)
    ngrams: dict[tuple[int, ...], set[int]] = field(default_factory=dict)  # (n-1)-gram -> tokens that followed it
    looped: bool = False  # the loop stop has seen a loop: the next step ends the sequence
    bad: BadWords | None = None  # its bad words, compiled (by the step control, which has the tokenizer)

    def sync(self, initial: list[int], generated: list[int], prompt_length: int) -> None:
        """Takes in the sequence's tokens (`initial` then `generated`, as the engine holds them) not seen yet; the
        first `prompt_length` are the prompt."""
        if not self.tokens:
            self.prompt_length = prompt_length
        start = len(self.tokens)
        for token in (initial[start:] if start < len(initial) else []):
            self._append(token)
        for token in generated[max(0, len(self.tokens) - len(initial)):]:
            self._append(token)
        if self.controls.loop_stop and not self.looped:
            self.looped = repeats_at_end(self.tokens[self.prompt_length:], self.controls.loop_stop,
                                         self.controls.loop_stop_span)

    def _append(self, token: int) -> None:
        self.tokens.append(token)
        if token not in self.seen:
            self.seen.add(token)
            self.seen_order.append(token)
        if len(self.tokens) > self.prompt_length:
            self.counts[token] += 1
        n = self.controls.no_repeat_ngram_size
        if n and len(self.tokens) >= n:
            self.ngrams.setdefault(tuple(self.tokens[-n:-1]), set()).add(token)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    def banned_ngram_tokens(self) -> set[int]:
        n = self.controls.no_repeat_ngram_size
        if not n or len(self.tokens) + 1 < n:
            return set()
        return self.ngrams.get(tuple(self.tokens[len(self.tokens) - n + 1:]) if n > 1 else (), set())


def repeats_at_end(tokens: list[int], times: int, longest: int) -> bool:
    """Whether `tokens` end with one span (of 1 to `longest` tokens) repeated `times` times in a row."""
    for span in range(1, longest + 1):
        if span * times > len(tokens):
            return False
        if tokens[-1] != tokens[-1 - span]:  # a span repeated ends with the token a span before the last
            continue
        tail = tokens[len(tokens) - span:]
        if all(tokens[len(tokens) - (k + 1) * span: len(tokens) - k * span] == tail for k in range(1, times)):
            return True
    return False


def apply_history(scores: torch.Tensor, rows: list[tuple[int, History]], eos: tuple[int, ...]) -> None:
    """Steps 1-5 of the module's order, in place, on the logits rows `rows` name (row index, its history). Each
    step is one indexed operation over every (row, token) pair it touches, in float32 (as transformers computes a
    bfloat16 logit times a Python float), rounded once to the logits' dtype."""
    ended = [(i, h) for i, h in rows if h.looped and eos]
    for i, _ in ended:  # the loop stop: only the end of the sequence is left
        keep = scores[i, eos[0]].clone()
        scores[i].fill_(float("-inf"))
        scores[i, eos[0]] = keep if torch.isfinite(keep) else 0.0
    live = [(i, h) for i, h in rows if not (h.looped and eos)]
    vocab = scores.size(1)
    bias = _Pairs()
    for i, h in live:
        bias.add(i, [t for t, _ in h.controls.logit_bias], [b for _, b in h.controls.logit_bias])
    bias.update(scores, lambda s, b: s + b[0], dtype=scores.dtype)  # as transformers: the bias in the logits' dtype
    repetition = _Pairs()
    for i, h in live:
        if h.controls.repetition_penalty != 1.0:
            repetition.add(i, h.seen_order, h.controls.repetition_penalty)
    repetition.update(scores, lambda s, p: torch.where(s < 0, s * p[0], s / p[0]))
    penalties = _Pairs()
    for i, h in live:
        c = h.controls
        if (c.presence_penalty or c.frequency_penalty) and h.counts:
            penalties.add(i, list(h.counts), list(h.counts.values()), c.frequency_penalty, c.presence_penalty)
    penalties.update(scores, lambda s, v: s - v[0] * v[1] - v[2])
    rows_of: list[int] = []  # (row, token) pairs to remove, as plain ints, and the bad words' index tensors
    banned: list[int] = []
    bad_rows: list[torch.Tensor] = []
    bad_ids: list[torch.Tensor] = []
    for i, h in live:
        found = list(h.banned_ngram_tokens())
        if eos and (h.controls.ignore_eos or h.generated < h.controls.min_tokens):
            found += eos
        banned += found
        rows_of += [i] * len(found)
        for ids in h.bad.banned(h.tokens) if h.bad is not None else ():
            if ids.numel():
                bad_ids.append(ids)
                bad_rows.append(torch.full_like(ids, i))
    if banned or bad_ids:
        r = torch.cat([_tensor(rows_of, np.int64), *bad_rows]).to(scores.device)
        t = torch.cat([_tensor(banned, np.int64), *bad_ids]).to(scores.device)
        keep = t < vocab
        scores[r[keep], t[keep]] = float("-inf")


def _tensor(values: list, dtype: Any) -> torch.Tensor:
    """A CPU tensor of a list of numbers, through numpy: torch.tensor reads a list of 12,800 ints in 1.3 ms, this
    in 0.15 (each step builds several, for every row's history)."""
    return torch.from_numpy(np.fromiter(values, dtype=dtype, count=len(values)))


class _Pairs:
    """(row, token) pairs of the logits, each with its values (a list with a value per pair, or one number for all
    of a row's pairs), read, changed and written back in one indexed operation over the flattened logits."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.lengths: list[int] = []
        self.ids: list[int] = []
        self.values: list[list[float]] = []
        self.per_pair: list[bool] = []

    def add(self, row: int, ids: list[int], *values: float | list[float]) -> None:
        if not ids:
            return
        if not self.values:
            self.values = [[] for _ in values]
            self.per_pair = [isinstance(v, list) for v in values]
        self.rows.append(row)
        self.lengths.append(len(ids))
        self.ids += ids
        for column, value in zip(self.values, values):
            if isinstance(value, list):
                column += value
            else:
                column.append(value)

    def update(self, scores: torch.Tensor, change: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor],
               dtype: torch.dtype = torch.float32) -> None:
        if not self.ids:
            return
        device, vocab = scores.device, scores.size(1)
        lengths = _tensor(self.lengths, np.int64).to(device)
        ids = _tensor(self.ids, np.int64).to(device)
        flat = torch.repeat_interleave(_tensor(self.rows, np.int64).to(device) * vocab, lengths) + ids
        values = [_tensor(v, np.float32).to(device) for v in self.values]
        values = [(v if per_pair else torch.repeat_interleave(v, lengths)).to(dtype)
                  for v, per_pair in zip(values, self.per_pair)]
        if max(self.ids) >= vocab:  # an id the logits do not have (a prompt's, past the model's head)
            keep = ids < vocab
            flat, values = flat[keep], [v[keep] for v in values]
        view = scores.view(-1) if scores.is_contiguous() else None
        if view is None:
            rows, cols = flat // vocab, flat % vocab
            scores[rows, cols] = change(scores[rows, cols].to(dtype), values).to(scores.dtype)
        else:
            view.index_copy_(0, flat, change(view.index_select(0, flat).to(dtype), values).to(scores.dtype))


def apply_min_p(scores: torch.Tensor, rows: list[tuple[int, float]]) -> None:
    """Step 7's filter, in place: in each named row, the tokens whose probability is below min_p times the most
    likely token's are removed (the most likely token always stays). A probability ratio is a difference of logits,
    so the test is score < best score + ln(min_p), in float32: one pass for the maximum and one for the mask, where
    transformers' MinPLogitsWarper computes a softmax first (its decisions are these but for tokens within float
    rounding of the threshold; 6 ms of a 64-sequence step on a 2-core Xeon, this 1.5)."""
    if not rows:
        return
    positions = [i for i, _ in rows]
    floor = torch.tensor([[math.log(p) if p > 0 else -math.inf] for _, p in rows], dtype=torch.float32,
                         device=scores.device)
    whole = positions == list(range(len(rows)))  # the usual case: every row, a view to change in place
    index = torch.tensor(positions, device=scores.device)
    picked = scores[: len(rows)] if whole else scores[index]
    threshold = picked.amax(dim=-1, keepdim=True).float() + floor
    picked.masked_fill_(picked < threshold, float("-inf"))
    if not whole:
        scores[index] = picked
