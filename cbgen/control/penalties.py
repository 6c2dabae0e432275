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
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

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
        self.seen.add(token)
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
        tail = tokens[len(tokens) - span:]
        if all(tokens[len(tokens) - (k + 1) * span: len(tokens) - k * span] == tail for k in range(1, times)):
            return True
    return False


def apply_history(scores: torch.Tensor, rows: list[tuple[int, History]], eos: tuple[int, ...]) -> None:
    """Steps 1-5 of the module's order, in place, on the logits rows `rows` name (row index, its history)."""
    for i, history in rows:
        c = history.controls
        row = scores[i]
        if history.looped and eos:  # the loop stop: only the end of the sequence is left
            keep = row[eos[0]].clone()
            row.fill_(float("-inf"))
            row[eos[0]] = keep if torch.isfinite(keep) else 0.0
            continue
        if c.logit_bias:
            ids = torch.tensor([t for t, _ in c.logit_bias], device=row.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in c.logit_bias], dtype=row.dtype, device=row.device))
        if c.repetition_penalty != 1.0 and history.seen:
            ids = torch.tensor(sorted(history.seen), device=row.device)
            ids = ids[ids < row.numel()]
            score = row[ids]
            row[ids] = torch.where(score < 0, score * c.repetition_penalty, score / c.repetition_penalty)
        if (c.presence_penalty or c.frequency_penalty) and history.counts:
            ids = torch.tensor(list(history.counts), device=row.device)
            counts = torch.tensor(list(history.counts.values()), dtype=row.dtype, device=row.device)
            row[ids] = row[ids] - counts * c.frequency_penalty - (counts > 0).to(row.dtype) * c.presence_penalty
        banned = history.banned_ngram_tokens()
        if banned:
            row[torch.tensor(sorted(banned), device=row.device)] = float("-inf")
        if history.bad is not None:
            for ids in history.bad.banned(history.tokens):
                row[ids.to(row.device)] = float("-inf")
        if eos and (c.ignore_eos or history.generated < c.min_tokens):
            row[torch.tensor(eos, device=row.device)] = float("-inf")


def apply_min_p(scores: torch.Tensor, rows: list[tuple[int, float]]) -> None:
    """Step 7's filter, in place: in each named row, the tokens whose probability is below min_p times the most
    likely token's are removed (transformers' MinPLogitsWarper; the most likely token always stays)."""
    for i, min_p in rows:
        probs = torch.softmax(scores[i], dim=-1)
        scores[i].masked_fill_(probs < min_p * probs.amax(), float("-inf"))
