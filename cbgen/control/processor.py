"""Control inside each decoding step: grammar masks, the model's own logprobs, and seeded sampling that does not
depend on batch-mates. Plugged into transformers' continuous batching as two of its per-request logits processors.

Each step, for the requests that get a new token:

1. `Mask` (first in the processor list) keeps the log-softmax of the raw logits (for logprobs and top logprobs:
   the model's own distribution, before temperature, top-k, top-p and any grammar) and masks, for each sequence
   that follows a format, the tokens its grammar does not allow next. End-of-sequence is allowed only where the
   grammar accepts, and a grammar that has ended allows nothing else. Then the history controls
   (cbgen.control.penalties).
2. transformers' own temperature, top-k and top-p stages run in between.
3. `Choose` (last) picks the token itself: the most likely one when the job is greedy, else an inverse-CDF draw:
   with u uniform in [0, 1), the first token whose cumulative weight under softmax(scores) passes u times the
   row's total, weights being integers (floor(exp(score - max) * 2^44), so their sums are exact in any order). u is
   a counter-based hash of (the request's seed, its sample index, the token's position) alone, so a seeded sequence
   is the same whatever shares its batch, in any order, after a resume, on any shard or rank; all rows of a step
   draw in one call of cbgen's compiled draw (cbgen.control.draw; cbgen/kernels/sampling.cpp: a row a thread),
   or of the same arithmetic in torch operators where the kernel cannot be built (and on a GPU). It leaves only the
   chosen token possible, so transformers' own sampling takes it, and it advances the sequence's grammar.

The same code runs wherever the logits are (on a CPU its "device" tensors are host tensors), and on a GPU a step
waits for the device at most once, whatever the number of rows: the chosen ids are computed on the device, then (when
the step records logprobs or follows a grammar) one batched gather of the chosen tokens' logprobs and one batched
top-k, packed with the ids and brought to the host in one copy; everything per row (records, the grammars' matchers)
reads that host copy. Everything else the step sends to the device is copied without waiting: the grammars' masks,
filled on the host by llguidance as packed bits (a 32-bit word per 32 tokens), only for the rows that follow a
format, and unpacked on the device (cbgen.control.bitmask: by llguidance's own torch helper on a GPU), and the
history controls' few values per row (cbgen.control.penalties keeps their state on the device). The loop stop and the
draw's fallback for rows with no finite score are selections on the device (torch.where), not Python branches.

The processors run in Python between the forward pass and sampling, so they need the engine's synchronous loop:
cbgen turns CUDA graphs and async batching off for jobs that use them (CPU has neither).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

from cbgen.chat.formats import ResponseFormat
from cbgen.control.bad_words import BadWords, VocabText
from cbgen.control.bitmask import apply_bitmask
from cbgen.control.draw import DrawBuffers, inverse_cdf_draw, uniform
from cbgen.control.grammars import Grammars
from cbgen.control.history_tensors import HistoryTensors, to_device
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


class StepControl:
    """The state the two processors share: one entry per sequence in the engine, keyed by its manager id."""

    def __init__(self, *, vocab_size: int, grammars: Grammars | None, do_sample: bool, capture: bool,
                 top_logprobs: int, eos: tuple[int, ...] = (), tokenizer: Any = None) -> None:
        self.eos = eos
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # for bad words given as text
        self._vocab_text: VocabText | None = None
        self._controls: dict[str, tuple[Controls, BadWords | None]] = {}  # parsed once per distinct key
        self.grammars = grammars
        self.do_sample = do_sample
        self.capture = capture or top_logprobs > 0
        self.top_logprobs = top_logprobs
        self._sequences: dict[str, _Sequence] = {}
        self._rows: list[_Sequence] = []  # this step's rows, in the order of the logits
        self._grammar_rows: list[int] = []  # this step's rows that follow a format, in the bitmask's order
        self._raw: torch.Tensor | None = None  # this step's log-softmax of the raw logits
        self._bitmask: torch.Tensor | None = None  # on the host (pinned where CUDA is): a row per grammar row
        self._fill: LLExecutor | None = None  # made on first use
        self._buffers = DrawBuffers()  # the sampled draw's working memory
        self._history = HistoryTensors()  # the penalties' state, on the logits' device

    def processors(self) -> tuple[Mask, Choose]:
        return Mask(self), Choose(self)

    def take(self, manager_id: str) -> SequenceRecord | None:
        """The record of a sequence that has ended (or was cancelled), forgetting it."""
        sequence = self._sequences.pop(manager_id, None)
        if sequence is None:
            return None
        if sequence.history is not None:
            self._history.release(sequence.history)
        return sequence.record

    def accepts(self, request, text: str) -> bool:
        """Whether `text` is a complete output of the request's format (for sequences a stop string cut)."""
        fmt = getattr(request, "response_format", None)
        return fmt is None or (self.grammars is not None and self.grammars.accepts(fmt, text))

    def forget_all(self) -> None:
        self._sequences.clear()
        self._rows = []
        self._grammar_rows = []
        self._history.clear()

    # ---------------------------------------------------------------------------------------------------------- #

    def prepare(self, requests_with_new_token: list) -> torch.Tensor:
        """Before the forward pass, on the host: which sequence each logits row is, their histories, and their
        grammars' masks (packed, a row per sequence that follows a format)."""
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
        self._grammar_rows = [i for i, sequence in enumerate(self._rows) if sequence.matcher is not None]
        if self._grammar_rows:
            from llguidance.torch import fill_next_token_bitmask_par

            # the previous step's copy of this buffer to the device is done: that step brought its tokens back
            # (`choose`), which waits for everything queued before
            masked = [(m, k) for k, i in enumerate(self._grammar_rows) if (m := self._rows[i].matcher) is not None]
            fill_next_token_bitmask_par(self._executor(), masked, self._bitmask_for(len(masked)))
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
            from llguidance.torch import allocate_token_bitmask

            self._bitmask = allocate_token_bitmask(max(rows, 64), self.vocab_size)  # pinned where CUDA is
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
        if self._grammar_rows:
            self._mask(scores[: len(rows)])
        controlled = [(i, s.history) for i, s in enumerate(rows) if s.history is not None]
        if controlled:
            apply_history(scores, controlled, self.eos, self._history)
        return scores

    def _mask(self, live: torch.Tensor) -> None:
        """The grammar rows' masks, packed as llguidance filled them, copied to the device without waiting and
        applied there."""
        grammar_rows = self._grammar_rows
        assert self._bitmask is not None
        bitmask = self._bitmask[: len(grammar_rows)].to(live.device, non_blocking=True)
        if len(grammar_rows) == live.size(0):  # every row follows a format: masked in place
            apply_bitmask(live, bitmask)
            return
        index = to_device(torch.from_numpy(np.array(grammar_rows, dtype=np.int64)), live.device)
        picked = live.index_select(0, index)
        apply_bitmask(picked, bitmask)
        live.index_copy_(0, index, picked)

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
        tokens, logprobs, top = self._to_host(chosen)
        for i, sequence in enumerate(rows):
            if logprobs is not None:
                sequence.record.logprobs.append(logprobs[i])
            if top is not None:
                sequence.record.top.append(top[i])
            if sequence.history is not None and sequence.history.looped:
                sequence.record.looped = True
            if sequence.matcher is not None:
                assert tokens is not None
                sequence.matcher.consume_token(tokens[i])
                sequence.record.accepted = sequence.matcher.is_accepting() or sequence.matcher.is_stopped()
        self._raw = None
        if not self.do_sample:  # transformers' argmax over these same scores picks the same tokens
            return scores
        live.fill_(float("-inf"))  # in place: the draw is made, and the raw log-softmax was kept apart
        live.scatter_(1, chosen.unsqueeze(1), 0.0)
        return scores

    def _to_host(self, chosen: torch.Tensor
                 ) -> tuple[list[int] | None, list[float] | None, list[tuple[list[int], list[float]]] | None]:
        """What the rows need of this step on the host, brought there in one copy (the step's one wait for the
        device): the chosen ids (for the grammars' matchers), their logprobs and the top logprobs, as the step
        records them. Nothing is copied when nothing is needed."""
        raw, k = self._raw, self.top_logprobs
        if raw is None and not self._grammar_rows:
            return None, None, None
        parts = [chosen.unsqueeze(1).to(torch.float64)]  # ids are exact in float64 (below 2^53)
        if raw is not None:
            parts.append(raw.gather(1, chosen.unsqueeze(1)).to(torch.float64))
            if k:
                values, ids = torch.topk(raw, k, dim=-1)
                parts += [values.to(torch.float64), ids.to(torch.float64)]
        host = torch.cat(parts, dim=1).cpu().numpy()
        tokens = host[:, 0].astype(np.int64).tolist()
        if raw is None:
            return tokens, None, None
        logprobs = host[:, 1].tolist()  # float32 values, exactly
        if not k:
            return tokens, logprobs, None
        values_list, ids_list = host[:, 2: 2 + k].tolist(), host[:, 2 + k:].astype(np.int64).tolist()
        return tokens, logprobs, list(zip(ids_list, values_list))

    def _draw(self, scores: torch.Tensor, rows: list[_Sequence]) -> torch.Tensor:
        for sequence in rows:
            if sequence.seed is None:  # unseeded: one random seed per sequence, drawn from torch's generator
                sequence.seed = int(torch.randint(0, 2**62, ()).item())  # a host tensor: nothing waits
        uniforms = np.fromiter((uniform(s.seed or 0, s.sample_index, s.position) for s in rows), dtype=np.float64,
                               count=len(rows))
        return inverse_cdf_draw(scores, to_device(torch.from_numpy(uniforms), scores.device), self._buffers)


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
