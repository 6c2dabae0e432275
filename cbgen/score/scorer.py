"""The scorer: the engine of a scoring job. It reads a window of rows ahead, packs them into forward passes by
length, and turns each pass's hidden states into the logprobs of the scored tokens, a bounded chunk of positions
at a time (cbgen.score.head), so neither padding nor tokens × vocabulary logits cost what a plain loop of the
model's forward over padded batches costs.

It yields a row's result as soon as its forward pass is done, as the generation engine does, so the job writes,
commits and resumes the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from cbgen.engine.scope import PACKED_ROWS, EngineScope, ScopePlan
from cbgen.errors import first_line
from cbgen.model.adapters import Adapter, applied
from cbgen.records import Completion, Score
from cbgen.render.prompts import LOOKAHEAD
from cbgen.score.batches import Batch, MaskShape, Piece, make_batch, pieces_of, plan_batches
from cbgen.score.head import check_head, chunk_positions, decoder_of, output_head
from cbgen.score.packed import make_packed, plan_packed
from cbgen.score.requests import ScoreRequest

SIDE_BY_SIDE_TOKENS = 8192  # longest row whose choices share one sequence: its mask is tokens² numbers


@dataclass
class ScorerStats:
    """What run.json says of the scorer (the engine's stats have the same place)."""

    forward_passes: int = 0
    padded_tokens: int = 0  # tokens of the batches, padding included
    tokens: int = 0  # tokens of the rows
    retried_alone: int = 0  # rows of a failed batch scored one by one
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"forward_passes": self.forward_passes, "tokens": self.tokens, "padded_tokens": self.padded_tokens,
                "retried_alone": self.retried_alone, "forward_s": round(self.seconds, 3), **self.settings}


class Scorer:
    """Scores ScoreRequests on `model`: `top_logprobs` alternatives per scored token on request, at most
    `batch_tokens` tokens per forward pass; with what `scope` installs (cbgen.engine.scope) while it runs. Rows go
    packed end to end, without padding, where the scope attends packed rows (cbgen.attention.packed: each row's
    bits its own); else in padded batches of similar lengths, or each alone where the scope is batch-invariant
    without the packed attention (then a batch has a row's own shapes only)."""

    def __init__(self, model: Any, *, batch_tokens: int, top_logprobs: int = 0, window: int = LOOKAHEAD,
                 scope: ScopePlan | None = None, adapter: Adapter | None = None) -> None:
        self.model = model
        self.adapter = adapter  # the job's LoRA adapter, merged into the weights while it scores
        self.scope = scope or ScopePlan()
        self.decoder = decoder_of(model)
        self.head = output_head(model)
        self.packed = self.scope.attention == PACKED_ROWS
        self.batch_tokens = 0 if self.scope.batch_invariant and not self.packed else batch_tokens
        self.top_logprobs = top_logprobs
        self.window = window
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.shape = MaskShape.of(model)
        self.chunk = chunk_positions(model.config.get_text_config().vocab_size)
        self.stats = ScorerStats(settings={"batch_tokens": self.batch_tokens, "logits_chunk_positions": self.chunk,
                                           "choices_side_by_side": self.shape is not None, "packed_rows": self.packed})
        self._checked = False

    def run(self, requests: Iterator[ScoreRequest], stop: threading.Event) -> Iterator[list[Completion]]:
        """Each request's result (a one-item list, as the engine yields groups), as its forward pass finishes;
        refused requests at once. Stops between passes once `stop` is set."""
        # quiets transformers too (cbgen.engine.changes)
        with applied(self.model, self.adapter), EngineScope(self.model, self.scope):
            window: list[ScoreRequest] = []
            for request in requests:
                if stop.is_set():
                    return
                if request.request.answered is not None:  # the result cache holds its scores
                    yield request.request.answered
                    continue
                if request.error is not None:
                    yield [_failed(request, request.error)]
                    continue
                window.append(request)
                if len(window) >= self.window:
                    yield from self._score(window, stop)
                    window = []
            yield from self._score(window, stop)

    def _score(self, window: list[ScoreRequest], stop: threading.Event) -> Iterator[list[Completion]]:
        if not window:
            return
        if not self._checked:
            check_head(self.model, self.head, window[0].context[:16])
            self._checked = True
        pieces: list[Piece] = []
        for row, request in enumerate(window):
            side_by_side = self.shape is not None and request.length <= SIDE_BY_SIDE_TOKENS
            pieces += pieces_of(row, request, side_by_side)
        waiting = {row: 0 for row in range(len(window))}
        for piece in pieces:
            waiting[piece.row] += 1
        found: dict[int, dict[int, list[tuple[int, float, Any]]]] = {row: {} for row in waiting}
        errors: dict[int, str] = {}
        for batch in (plan_packed(pieces, self.batch_tokens) if self.packed else
                      plan_batches(pieces, self.batch_tokens)):
            if stop.is_set():
                return
            for piece, scored, error in self._run_batch(batch):
                if error is not None:
                    errors[piece.row] = error
                for unit, value in scored.items():
                    found[piece.row].setdefault(unit, []).extend(value)
                waiting[piece.row] -= 1
                if waiting[piece.row] == 0:
                    request = window[piece.row]
                    message = errors.get(piece.row)
                    yield [_failed(request, message) if message else _completion(request, found.pop(piece.row))]

    def _run_batch(self, pieces: list[Piece]
                   ) -> Iterator[tuple[Piece, dict[int, list[tuple[int, float, Any]]], str | None]]:
        """(piece, its scored tokens by unit, error) for each piece; a batch that fails is retried piece by piece,
        so one bad row never costs the others their scores."""
        try:
            results = self._forward(pieces)
        except Exception as e:  # noqa: BLE001 - whatever one batch meets, the job goes on
            if len(pieces) == 1:
                yield pieces[0], {}, f"scoring failed: {type(e).__name__}: {first_line(e, 200)}"
                return
            self.stats.retried_alone += len(pieces)
            for piece in pieces:
                yield from self._run_batch([piece])
            return
        for piece, scored in zip(pieces, results):
            yield piece, scored, None

    @torch.inference_mode()
    def _forward(self, pieces: list[Piece]) -> list[dict[int, list[tuple[int, float, Any]]]]:
        started = time.perf_counter()
        batch = make_packed(pieces, self.device) if self.packed else \
            make_batch(pieces, self.shape, self.dtype, self.device)
        hidden = self.decoder(**batch.forward_kwargs()).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        where = [(b, unit, token) for b, piece in enumerate(pieces) for unit, _, token in piece.targets]
        index = torch.tensor([batch.flat(b, i) for b, piece in enumerate(pieces) for _, i, _ in piece.targets],
                             device=self.device)
        targets = torch.tensor([token for _, _, token in where], device=self.device)
        logprobs, top = self._logprobs(flat.index_select(0, index), targets)
        results: list[dict[int, list[tuple[int, float, Any]]]] = [{} for _ in pieces]
        for n, (b, unit, token) in enumerate(where):
            results[b].setdefault(unit, []).append((token, logprobs[n], top[n] if top is not None else None))
        self._count(batch, time.perf_counter() - started)
        return results

    def _logprobs(self, hidden: torch.Tensor, targets: torch.Tensor
                  ) -> tuple[list[float], list[tuple[list[int], list[float]]] | None]:
        """The log-softmax of the model's logits at each target, and the top alternatives on request, a chunk of
        positions at a time: never more than `chunk` positions' logits at once."""
        values: list[float] = []
        top: list[tuple[list[int], list[float]]] | None = [] if self.top_logprobs else None
        for start in range(0, hidden.shape[0], self.chunk):
            logprobs = self.head(hidden[start:start + self.chunk]).float().log_softmax(-1)
            chosen = targets[start:start + self.chunk]
            values += logprobs.gather(1, chosen[:, None])[:, 0].tolist()
            if top is not None:
                best = logprobs.topk(self.top_logprobs, dim=-1)
                top += list(zip(best.indices.tolist(), best.values.tolist()))
            del logprobs
        return values, top

    def _count(self, batch: Batch, seconds: float) -> None:
        stats = self.stats
        stats.forward_passes += 1
        stats.padded_tokens += batch.input_ids.numel()
        stats.tokens += sum(len(p.ids) for p in batch.pieces)
        stats.seconds += seconds


def _failed(request: ScoreRequest, error: str) -> Completion:
    """A row that could not be scored, its error after its input location (as `cbgen run` says them)."""
    return Completion(request.request, 0, [], None, "error", error=f"{request.request.record.location}: {error}",
                      rejected=request.error is not None)


def _completion(request: ScoreRequest, units: dict[int, list[tuple[int, float, Any]]]) -> Completion:
    """A scored row: its tokens, their logprobs and alternatives (a completion or a text), or each choice's sum."""
    if not request.has_choices:
        scored = units[0]
        tokens = [token for token, _, _ in scored]
        logprobs = [value for _, value, _ in scored]
        top = [alternatives for _, _, alternatives in scored] if scored and scored[0][2] is not None else None
        return Completion(request.request, 0, tokens, logprobs, "stop", top_logprobs=top,
                          score=Score(logprob=float(sum(logprobs))))
    ordered = [units[unit] for unit in range(len(request.continuations))]
    sums = [float(sum(value for _, value, _ in scored)) for scored in ordered]
    lengths = [len(scored) for scored in ordered]
    flat = [item for scored in ordered for item in scored]  # each choice's tokens in turn (choice_tokens splits them)
    top = [alternatives for _, _, alternatives in flat] if flat and flat[0][2] is not None else None
    return Completion(request.request, 0, [token for token, _, _ in flat], [value for _, value, _ in flat], "stop",
                      top_logprobs=top, score=Score(choice_logprobs=sums, choice_tokens=lengths))
