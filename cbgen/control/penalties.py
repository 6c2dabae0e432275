"""Controls over each sequence's own history, applied inside the decoding step: penalties, n-gram bans, logit bias,
min_p, a floor on the length (min_tokens, ignore_eos) and the loop stop.

transformers' continuous batching cannot carry these: its history-dependent processors see only the current token
of a request, and unsupported ones are dropped. cbgen's step control (cbgen.control.processor) knows each sequence
by its manager id, so it keeps the history here, incrementally (a token per step), and applies every control to the
rows that ask for it, so a sequence's scores never depend on its batch-mates' settings.

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

Where the work happens, so that a step on a GPU never waits for it (no device-to-host copy, no Python branch on a
device value, no operation whose output size depends on device data):
- the token ids reach the host anyway (the engine's request states), so the host keeps what is cheap there and needs
  only the ids: each sequence's tokens, its n-grams, its bad words' tails and the loop detector (`History`);
- the penalties' state lives on the scores' device (`HistoryTensors`, cbgen.control.history_tensors): per sequence
  that uses repetition_penalty, the distinct ids of its prompt and generated tokens, and per sequence that uses
  presence or frequency penalties, the distinct generated ids and how often each came, each a row (a slot) of a pooled
  [slots, width] tensor. A slot is seeded once from the prompt, and a step writes only what changed (in the usual
  step, one id or one count per sequence) in one indexed write; the host knows each list's length and each id's place
  in it, so no step asks the device for them. Lists of ids, not [slots, vocabulary] masks: a step then reads and
  writes only the tokens a sequence has seen (hundreds), not its whole vocabulary row, which on a CPU would cost
  several passes over every row's 49,152 or 152,064 scores per control and step;
- each step's small per-row values (rows, slots, lengths, penalties, biases, banned ids) are built on the host in one
  pass and copied to the device together: one copy of integers and one of floats, neither waited for.
Every change is computed as before, value for value: float32 arithmetic on the gathered scores, rounded once to
the scores' dtype (as transformers computes a bfloat16 logit times a Python float), the bias in the scores' dtype.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from cbgen.control.bad_words import BadWord, BadWords
from cbgen.control.draw import draw_kernel
from cbgen.control.history_tensors import HistoryTensors, Lists, Upload, to_device

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


@dataclass(eq=False)  # compared and hashed by identity: HistoryTensors keys its slots by the History
class History:
    """What the controls need of one sequence's tokens on the host, kept up to date a step at a time."""

    controls: Controls
    prompt_length: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt and generated
    ngrams: dict[tuple[int, ...], set[int]] = field(default_factory=dict)  # (n-1)-gram -> tokens that followed it
    looped: bool = False  # the loop stop has seen a loop: the next step ends the sequence
    bad: BadWords | None = None  # its bad words, compiled (by the step control, which has the tokenizer)

    def __post_init__(self) -> None:
        c = self.controls
        self.bias_ids = np.array([t for t, _ in c.logit_bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in c.logit_bias], dtype=np.float32)
        self.repetition = c.repetition_penalty != 1.0
        self.penalised = bool(c.presence_penalty or c.frequency_penalty)

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


def apply_history(scores: torch.Tensor, rows: list[tuple[int, History]], eos: tuple[int, ...],
                  tensors: HistoryTensors | None = None) -> None:
    """Steps 1-5 of the module's order, in place, on the logits rows `rows` name (row index, its history), on the
    scores' device without waiting for it. `tensors`: the penalties' device state kept from step to step (without
    it, one made for this call alone). Each step is one indexed operation over every (row, token) pair it touches,
    in float32, rounded once to the logits' dtype."""
    tensors = tensors if tensors is not None else HistoryTensors()
    device, vocab = scores.device, scores.size(1)
    upload = Upload()
    ended = [i for i, h in rows if h.looped and eos]  # the loop stop: only the end of the sequence is left
    live = [(i, h) for i, h in rows if not (h.looped and eos)]
    steps: list[Callable[[], None]] = []
    if ended:
        at = upload.ints(np.array(ended, dtype=np.int64))[0]

        def loop_stop() -> None:
            index = upload.int_tensor(at)
            keep = scores[index, eos[0]]
            scores.index_fill_(0, index, float("-inf"))
            scores[index, eos[0]] = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))

        steps.append(loop_stop)
    biased = [(i, h) for i, h in live if h.bias_ids.size]
    if biased:
        ids = np.concatenate([h.bias_ids for _, h in biased])
        values = np.concatenate([h.bias_values for _, h in biased])
        row_of = np.repeat(np.array([i for i, _ in biased], dtype=np.int64), [h.bias_ids.size for _, h in biased])
        keep = ids < vocab
        pairs = upload.ints(np.stack([row_of[keep], ids[keep]]))[0]
        bias = upload.floats(values[keep])

        def logit_bias() -> None:
            r, t = upload.int_tensor(pairs)
            scores[r, t] = scores[r, t] + upload.float_tensor(bias).to(scores.dtype)  # as transformers: in its dtype

        steps.append(logit_bias)
    for lists, wanted in ((tensors.seen, "repetition"), (tensors.generated, "penalised")):
        users = [(i, h) for i, h in live if getattr(h, wanted)]
        if not users:
            continue
        lists.on(device)
        found = [(i, h, *lists.take_in(h, vocab)) for i, h in users]
        steps.insert(0, lists.write(upload))  # the lists are brought up to date before anything reads them
        found = [f for f in found if f[3]]  # a sequence with nothing to penalise yet is left alone
        if found:
            steps.append(_penalty(scores, lists, found, upload))
    banned = _bans(scores, live, eos, upload)
    if banned is not None:
        steps.append(banned)
    if not steps:
        return
    upload.send(device)
    for step in steps:
        step()


def _penalty(scores: torch.Tensor, lists: Lists, found: list[tuple[int, History, int, int]], upload: Upload
             ) -> Callable[[], None]:
    """Step 2 (lists of seen ids) or 3 (lists of generated ids and counts) over the rows `found` names (row, history,
    slot, list length): one gather of each row's listed scores, padded to the longest list by repeating the row's
    first listed token (its twin computes the same value, so the write is the same whichever lands last)."""
    width = max(f[3] for f in found)
    index = upload.ints(np.array([[f[0] for f in found], [f[2] for f in found], [f[3] for f in found]],
                                 dtype=np.int64))[0]
    if lists.counted:
        values = upload.floats(np.array([[f[1].controls.frequency_penalty for f in found],
                                         [f[1].controls.presence_penalty for f in found]], dtype=np.float32))
    else:
        values = upload.floats(np.array([f[1].controls.repetition_penalty for f in found], dtype=np.float32))

    def run() -> None:
        rows, slots, lengths = upload.int_tensor(index)
        places = torch.arange(width, device=scores.device)
        places = torch.where(places < lengths[:, None], places, torch.zeros_like(places))  # [rows, width]
        ids = lists.ids[slots[:, None], places]
        rows = rows[:, None].expand_as(ids)
        s = scores[rows, ids].to(torch.float32)
        v = upload.float_tensor(values)
        if lists.counted:
            changed = s - lists.counts[slots[:, None], places] * v[0][:, None] - v[1][:, None]
        else:
            p = v[:, None]
            changed = torch.where(s < 0, s * p, s / p)
        scores[rows, ids] = changed.to(scores.dtype)

    return run


def _bans(scores: torch.Tensor, live: list[tuple[int, History]], eos: tuple[int, ...], upload: Upload
          ) -> Callable[[], None] | None:
    """Steps 4-5: the (row, token) pairs no sequence may take next, set to -inf: n-gram bans, the end held back by
    min_tokens or ignore_eos and the bad words' history-dependent ids, as one list of pairs; each set of bad words'
    ids that are banned whatever the history, once per set over all of its rows (kept on the device)."""
    rows_of: list[int] = []  # (row, token) pairs, as plain ints, and the bad words' index arrays
    banned: list[int] = []
    bad_rows: list[np.ndarray] = []
    bad_ids: list[np.ndarray] = []
    always: dict[int, tuple[BadWords, list[int]]] = {}
    vocab = scores.size(1)
    for i, h in live:
        found = list(h.banned_ngram_tokens())
        if eos and (h.controls.ignore_eos or h.generated < h.controls.min_tokens):
            found += eos
        banned += found
        rows_of += [i] * len(found)
        if h.bad is not None:
            if h.bad.always.numel():
                always.setdefault(id(h.bad), (h.bad, []))[1].append(i)
            for ids in h.bad.following(h.tokens):
                if ids.numel():
                    bad_ids.append(ids.numpy())
                    bad_rows.append(np.full(ids.numel(), i, dtype=np.int64))
    pairs = None
    if banned or bad_ids:
        r = np.concatenate([np.array(rows_of, dtype=np.int64), *bad_rows])
        t = np.concatenate([np.array(banned, dtype=np.int64), *bad_ids])
        keep = t < vocab
        pairs = upload.ints(np.stack([r[keep], t[keep]]))[0]
    groups = [(_always_on(bad, scores.device, vocab), upload.ints(np.array(rows, dtype=np.int64))[0])
              for bad, rows in always.values()]
    if pairs is None and not groups:
        return None

    def run() -> None:
        if pairs is not None:
            r, t = upload.int_tensor(pairs)
            scores[r, t] = float("-inf")
        for ids, at in groups:
            scores[upload.int_tensor(at)[:, None], ids[None, :]] = float("-inf")

    return run


def _always_on(bad: BadWords, device: torch.device, vocab: int) -> torch.Tensor:
    """The ids `bad` bans after any tokens, on `device` and below `vocab`: copied there once."""
    ids = bad.on.get((device, vocab))
    if ids is None:
        ids = bad.on[device, vocab] = to_device(bad.always[bad.always < vocab], device)
    return ids


def apply_min_p(scores: torch.Tensor, rows: list[tuple[int, float]], compiled: bool = True) -> None:
    """Step 7's filter, in place: in each named row, the tokens whose probability is below min_p times the most
    likely token's are removed (the most likely token always stays). A probability ratio is a difference of logits,
    so the test is score < best score + ln(min_p), in float32: one pass for the maximum and one for the mask, where
    transformers' MinPLogitsWarper computes a softmax first (its decisions are these but for tokens within float
    rounding of the threshold; 6 ms of a 64-sequence step on a 2-core Xeon, this 1.5). `compiled`: on CPU through
    cbgen's compiled sampling kernel where it built (a row a thread, the same decisions: 2.6 ms of torch operators
    a 64-row step of 49,152 tokens on a 2-core Zen 4); else, and on other devices, in torch operators, the rows'
    values reaching the device in one copy that is not waited for."""
    if not rows:
        return
    positions = [i for i, _ in rows]
    floors = np.array([[math.log(p) if p > 0 else -math.inf] for _, p in rows], dtype=np.float32)
    if compiled and scores.device.type == "cpu" and scores.stride(-1) == 1 and (ops := draw_kernel()[0]) is not None:
        ops.min_p_rows_(scores, torch.tensor(positions, dtype=torch.int64), torch.from_numpy(floors[:, 0]))
        return
    upload = Upload()
    floor = upload.floats(floors)
    whole = positions == list(range(len(rows)))  # the usual case: every row, a view to change in place
    at = None if whole else upload.ints(np.array(positions, dtype=np.int64))[0]
    upload.send(scores.device)
    index = None if at is None else upload.int_tensor(at)
    picked = scores[: len(rows)] if index is None else scores[index]
    threshold = picked.amax(dim=-1, keepdim=True).float() + upload.float_tensor(floor)
    picked.masked_fill_(picked < threshold, float("-inf"))
    if index is not None:
        scores[index] = picked
