"""Control inside each decoding step: grammar masks, the model's own logprobs, and seeded sampling that does not
depend on batch-mates. Plugged into transformers' continuous batching as two of its per-request logits processors.

Each step, for the requests that get a new token:

1. `Mask` (first in the processor list) keeps the log-softmax of the raw logits (for logprobs and top logprobs:
   the model's own distribution, before temperature, top-k, top-p and any grammar) and masks, for each sequence
   that follows a format, the tokens its grammar does not allow next. End-of-sequence is allowed only where the
   grammar accepts, and a grammar that has ended allows nothing else.
2. transformers' own temperature, top-k and top-p stages run in between.
3. `Choose` (last) picks the token itself: the most likely one when the job is greedy, else an inverse-CDF draw:
   with u uniform in [0, 1), the first token whose cumulative weight under softmax(scores) passes u times the
   row's total, weights being integers (floor(exp(score - max) * 2^44), so their sums are exact in any order). u is
   a counter-based hash of (the request's seed, its sample index, the token's position) alone, so a seeded sequence
   is the same whatever shares its batch, in any order, after a resume, on any shard or rank; all rows of a step
   draw in one call of cbgen's compiled draw (cbgen/kernels/sampling.cpp: a row a thread, one pass over its scores),
   or of the same arithmetic in torch operators where the kernel cannot be built. It leaves only the chosen token
   possible, so transformers' own sampling takes it, and it advances the sequence's grammar.

The processors run in Python between the forward pass and sampling, so they need the engine's synchronous loop:
cbgen turns CUDA graphs and async batching off for jobs that use them (CPU has neither).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

from cbgen.chat.formats import ResponseFormat
from cbgen.control.bad_words import BadWords, VocabText
from cbgen.control.grammars import Grammars
from cbgen.control.penalties import CONTROLS_KWARG, Controls, History, apply_history, apply_min_p
from cbgen.records import sample_index

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher

GRAMMAR_KWARG = "response_format"  # the format's key (ResponseFormat.key), as a request's processor kwarg
SEED_KWARG = "sample_seed"  # the request's seed (cbgen derives it from the job's or row's seed and the input id)


@dataclass
class SequenceRecord:
    """What the steps recorded of one sequence, handed to the engine when it ends."""

    logprobs: list[float] = field(default_factory=list)  # the model's own, of each chosen token
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per token: the k most likely
    grammar: bool = False  # it followed a format
    accepted: bool = False  # its format was complete when it ended (or could end there)
    looped: bool = False  # the loop stop ended it: its last token is the end-of-sequence it was given


@dataclass
class _Sequence:
    record: SequenceRecord
    matcher: LLMatcher | None = None
    seed: int | None = None
    sample_index: int = 0
    position: int = 0  # of the token this step draws: how many the sequence has generated before it
    history: History | None = None  # its history controls' state, when it has any


def uniform(seed: int, index: int, position: int) -> float:
    """The uniform number in [0, 1) of one token draw: a function of (seed, sample index, position) alone (53 bits
    of a blake2b hash)."""
    digest = hashlib.blake2b(f"{seed}:{index}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / 2**53


WEIGHT_SCALE = 2**44  # a token's weight: floor(exp(score - the row's best) * 2^44), an integer (the best is 2^44)


class DrawBuffers:
    """The eager draw's working memory, kept from step to step: a fresh 25 MB cumulative sum per step (64 rows of
    49,152) cost more in page faults than in arithmetic (measured 5 to 25 ms for the same cumulative sum)."""

    def __init__(self) -> None:
        self.weights = torch.empty(0)
        self.cdf = torch.empty(0, dtype=torch.int64)

    def get(self, rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.weights.shape[0] < rows or self.weights.shape[1:] != (vocab,) or self.weights.device != device:
            self.weights = torch.empty(rows, vocab, device=device)
            self.cdf = torch.empty(rows, vocab, dtype=torch.int64, device=device)
        return self.weights[:rows], self.cdf[:rows]


@functools.lru_cache(maxsize=1)
def draw_kernel() -> tuple[Any, str]:
    """(torch.ops.cbgen_kernels with the compiled draw loaded, "compiled") or (None, why the eager draw runs)."""
    from cbgen.kernels import kernel

    built = kernel("sampling")
    if not built.loaded:
        return None, f"eager: {built.detail}"
    return torch.ops.cbgen_kernels, "compiled"


def inverse_cdf_draw(scores: torch.Tensor, uniforms: torch.Tensor, buffers: DrawBuffers | None = None,
                     compiled: bool = True) -> torch.Tensor:
    """One token per row of `scores` ([rows, vocab]) drawn from softmax(scores) by its uniform number ([rows],
    float64): the first token whose cumulative weight passes u times the row's total, with integer weights
    floor(exp(score - max) * 2^44) (exact sums, so the order of addition cannot move a draw; a token more than 30.5
    nats below the row's best has weight 0 and is never drawn). A row whose best score is not finite takes its first
    best token. `compiled`: through cbgen's compiled kernel (cbgen/kernels/sampling.cpp) on CPU where it built, one
    pass per row; else, or on other devices, the same arithmetic in torch operators (`buffers`: their working memory
    to reuse), whose exp may round a last bit differently from the kernel's."""
    scores = scores.float()
    if compiled and scores.device.type == "cpu" and (ops := draw_kernel()[0]) is not None:
        rows = scores if scores.stride(-1) == 1 else scores.contiguous()
        return ops.draw_rows(rows, uniforms.to(torch.float64).contiguous())
    weights, cdf = (buffers or DrawBuffers()).get(scores.shape[0], scores.shape[1], scores.device)
    top = scores.amax(dim=-1, keepdim=True)
    torch.sub(scores, top, out=weights).exp_().mul_(WEIGHT_SCALE)
    torch.cumsum(weights.to(torch.int64), dim=-1, out=cdf)  # the float-to-integer conversion truncates
    total = cdf[:, -1:]
    target = (uniforms.to(torch.float64).unsqueeze(1) * total.double()).to(torch.int64)
    target = torch.minimum(target.clamp_(min=0), total - 1)
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=scores.size(1) - 1)
    unweighable = ~torch.isfinite(top.squeeze(1))
    if bool(unweighable.any()):
        chosen[unweighable] = _first_best(scores[unweighable])
    return chosen


def _first_best(scores: torch.Tensor) -> torch.Tensor:
    """The first highest score's index of each row, NaN read as -inf (rows with no finite maximum)."""
    return torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")).argmax(dim=-1)


class StepControl:
    """The state the two processors share: one entry per sequence in the engine, keyed by its manager id."""

    def __init__(self, *, vocab_size: int, grammars: Grammars | None, do_sample: bool, capture: bool,
                 top_logprobs: int, eos: tuple[int, ...] = (), tokenizer: Any = None) -> None:
        self.eos = eos
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # for bad words given as text
        self._vocab_text: VocabText | None = None
        self._controls: dict[str, tuple[Controls, BadWords | None]] = {}  # parsed once per distinct key
        self.vocab_words = (vocab_size + 31) // 32
        self.grammars = grammars
        self.do_sample = do_sample
        self.capture = capture or top_logprobs > 0
        self.top_logprobs = top_logprobs
        self._sequences: dict[str, _Sequence] = {}
        self._rows: list[_Sequence] = []  # this step's rows, in the order of the logits
        self._raw: torch.Tensor | None = None  # this step's log-softmax of the raw logits
        self._bitmask: torch.Tensor | None = None
        self._fill: LLExecutor | None = None  # made on first use
        self._buffers = DrawBuffers()  # the sampled draw's working memory

    def processors(self) -> tuple[Mask, Choose]:
        return Mask(self), Choose(self)

    def take(self, manager_id: str) -> SequenceRecord | None:
        """The record of a sequence that has ended (or was cancelled), forgetting it."""
        sequence = self._sequences.pop(manager_id, None)
        return sequence.record if sequence is not None else None

    def accepts(self, request, text: str) -> bool:
        """Whether `text` is a complete output of the request's format (for sequences a stop string cut)."""
        fmt = getattr(request, "response_format", None)
        return fmt is None or (self.grammars is not None and self.grammars.accepts(fmt, text))

    def forget_all(self) -> None:
        self._sequences.clear()
        self._rows = []

    # ---------------------------------------------------------------------------------------------------------- #

    def prepare(self, requests_with_new_token: list) -> torch.Tensor:
        """Before the forward pass: which sequence each logits row is, and their grammars' masks."""
        self._rows = [self._sequence(request.state) for request in requests_with_new_token]
        for request, sequence in zip(requests_with_new_token, self._rows):
            state = request.state
            initial, generated = state.initial_tokens, state.generated_tokens
            # after a soft reset the generated tokens so far are part of initial_tokens: the prompt is the first
            # _true_initial_tokens of them
            prompt = getattr(state, "_true_initial_tokens", 0) or len(initial)
            sequence.position = len(initial) + len(generated) - prompt
            if sequence.history is not None:
                sequence.history.sync(initial, generated, prompt)
        masked = [(sequence.matcher, i) for i, sequence in enumerate(self._rows) if sequence.matcher is not None]
        if masked:
            from llguidance.torch import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(self._executor(), masked, self._bitmask_for(len(self._rows)))
        return torch.tensor([s.matcher is not None for s in self._rows], dtype=torch.int32)

    def _sequence(self, state) -> _Sequence:
        sequence = self._sequences.get(state.request_id)
        if sequence is None:
            kwargs = state.logit_processor_kwargs
            sequence = _Sequence(SequenceRecord(), seed=kwargs.get(SEED_KWARG),
                                 sample_index=sample_index(state.request_id))
            controls = kwargs.get(CONTROLS_KWARG)
            if controls:
                if controls not in self._controls:
                    self._controls[controls] = self._parse(controls)
                parsed, bad = self._controls[controls]
                sequence.history = History(parsed, bad=bad)
            key = kwargs.get(GRAMMAR_KWARG)
            if key and self.grammars is not None:
                sequence.matcher = self.grammars.matcher(ResponseFormat.from_key(key))
                sequence.record.grammar = True
            self._sequences[state.request_id] = sequence
        return sequence

    def _parse(self, key: str) -> tuple[Controls, BadWords | None]:
        controls = Controls.from_key(key)
        if not controls.bad_words:
            return controls, None
        if self._vocab_text is None and any(isinstance(w, str) for w in controls.bad_words):
            self._vocab_text = VocabText.of(self.tokenizer, self.vocab_size)
        return controls, BadWords(controls.bad_words, self.eos, self._vocab_text)

    def _executor(self):
        if self._fill is None:
            from llguidance import LLExecutor

            self._fill = LLExecutor()  # computes the masks of many matchers on a thread pool
        return self._fill

    def _bitmask_for(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = torch.full((max(rows, 64), self.vocab_words), -1, dtype=torch.int32)
        return self._bitmask

    # ---------------------------------------------------------------------------------------------------------- #

    # The logits hold a row per request in the batch, those with a new token first and in the order `prepare` saw
    # them; rows after those belong to requests still prefilling, and are never sampled from.

    def first(self, scores: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if scores.size(0) < len(rows):  # not a step this control prepared (a warm-up pass)
            self._raw = None
            return scores
        if self.capture:
            self._raw = torch.log_softmax(scores[: len(rows)].float(), dim=-1)
        masked = [i for i, sequence in enumerate(rows) if sequence.matcher is not None]
        if masked:
            bitmask = self._bitmask_for(len(rows))[: len(rows)]  # filled by `prepare`
            blocked = _blocked(bitmask, scores.size(1)).to(scores.device, non_blocking=True)
            if len(masked) == len(rows):
                scores[: len(rows)].masked_fill_(blocked, float("-inf"))
            else:
                index = torch.tensor(masked, device=scores.device)
                scores[index] = scores[index].masked_fill(blocked[index], float("-inf"))
        controlled = [(i, s.history) for i, s in enumerate(rows) if s.history is not None]
        if controlled:
            apply_history(scores, controlled, self.eos)
        return scores

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if scores.size(0) < len(rows) or not rows:
            return scores
        live = scores[: len(rows)]
        min_p = [(i, s.history.controls.min_p) for i, s in enumerate(rows)
                 if s.history is not None and s.history.controls.min_p > 0 and not s.history.looped]
        if min_p and self.do_sample:
            apply_min_p(live, min_p)
        chosen = torch.argmax(live, dim=-1) if not self.do_sample else self._draw(live, rows)
        for i, sequence in enumerate(rows):
            token = int(chosen[i])
            if self._raw is not None:
                raw = self._raw[i]
                sequence.record.logprobs.append(float(raw[token]))
                if self.top_logprobs:
                    values, ids = torch.topk(raw, self.top_logprobs)
                    sequence.record.top.append((ids.tolist(), values.tolist()))
            if sequence.history is not None and sequence.history.looped:
                sequence.record.looped = True
            if sequence.matcher is not None:
                sequence.matcher.consume_token(token)
                sequence.record.accepted = sequence.matcher.is_accepting() or sequence.matcher.is_stopped()
        self._raw = None
        if not self.do_sample:  # transformers' argmax over these same scores picks the same tokens
            return scores
        live.fill_(float("-inf"))  # in place: the draw is made, and the raw log-softmax was kept apart
        live.scatter_(1, chosen.unsqueeze(1).to(live.device), 0.0)
        return scores

    def _draw(self, scores: torch.Tensor, rows: list[_Sequence]) -> torch.Tensor:
        for sequence in rows:
            if sequence.seed is None:  # unseeded: one random seed per sequence, drawn from torch's generator
                sequence.seed = int(torch.randint(0, 2**62, ()).item())
        uniforms = torch.tensor([uniform(s.seed or 0, s.sample_index, s.position) for s in rows], dtype=torch.float64)
        return inverse_cdf_draw(scores, uniforms.to(scores.device), self._buffers).cpu()


def _blocked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit j of word w allows token 32 * w + j) -> [rows, vocab] bool, True where the
    token is not allowed. numpy unpacks bits in one C loop, several times faster than torch's shifts on a CPU."""
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(allowed).view(torch.bool).logical_not_()


class _Processor(ContinuousBatchingLogitsProcessor):
    supported_kwargs: dict[str, type] = {GRAMMAR_KWARG: str, SEED_KWARG: int, CONTROLS_KWARG: str}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, control: StepControl) -> None:
        self.control = control

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)


class Mask(_Processor):
    def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:
        return self.control.prepare(requests_with_new_token)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return self.control.first(scores)


class Choose(_Processor):
    supported_kwargs: dict[str, type] = {}

    def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return self.control.choose(scores)


def take_over_sampling(manager, control: StepControl) -> Callable[[], None] | None:
    """After `warmup()`: when the control draws the tokens, transformers' own draw (a softmax and torch.multinomial
    over the whole vocabulary, 130 ms of a 64-sequence step on a 2-core CPU) would only find the one token the
    control left possible, so the manager's model runner takes the argmax instead. Its temperature, top-k and top-p
    stages, built from the generation config, still run before the control's draw. Returns what undoes it (None when
    nothing was changed)."""
    runner = getattr(getattr(manager, "batch_processor", None), "model_runner", None)
    if not control.do_sample or runner is None or not hasattr(runner, "do_sample"):
        return None
    before, runner.do_sample = runner.do_sample, False

    def undo() -> None:
        runner.do_sample = before

    return undo


def install(manager, control: StepControl) -> Callable[[], None]:
    """Puts the control's processors first and last in a manager's processor list, before its batch processor (and
    the processors' argument storage) is built, that is before `warmup()` or `start()`. Returns what takes them out
    again (for a manager that lives on; a destroyed one takes them with it)."""
    mask, choose = control.processors()
    processors = manager.logit_processor
    before = (processors.tensors_required, processors.do_processing, dict(processors.supported_keys))
    processors.logits_processor.insert(0, mask)
    processors.logits_processor.append(choose)
    processors.tensors_required += 2
    processors.supported_keys.update(mask.supported_kwargs)
    processors.do_processing = True

    def undo() -> None:
        processors.logits_processor[:] = [p for p in processors.logits_processor if p is not mask and p is not choose]
        processors.tensors_required, processors.do_processing = before[0], before[1]
        processors.supported_keys.clear()
        processors.supported_keys.update(before[2])

    return undo
