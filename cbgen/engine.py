"""Drives transformers' ContinuousBatchingManager over a stream of requests with a bounded in-flight window.

Results are yielded as they finish, so the caller writes them out while generation goes on and memory does not grow
with the input. Requests that can never run (longer than the model's context, or than the KV cache can ever hold)
are failed here, before admission: inside the manager they would stop the generation loop for every request. If
the loop dies anyway, the requests in flight are failed with its error and a fresh manager carries on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from math import ceil

from cbgen.prompts import Request

log = logging.getLogger(__name__)

CHILD_MARK = "__child#"  # transformers names the extra sequences of a request "<id>__child#<k>"


@dataclass(slots=True)
class Completion:
    """One returned sequence of a request (several per request with num_return_sequences > 1)."""

    request: Request
    sample_index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.input_ids or [])


@dataclass
class _InFlight:
    request: Request
    max_new_tokens: int
    returned: set[int] = field(default_factory=set)  # sample indices already yielded


@dataclass
class EngineStats:
    restarts: int = 0
    num_blocks: int | None = None
    page_size: int | None = None
    resolved_config: dict = field(default_factory=dict)


class Engine:
    """Feeds requests to a ContinuousBatchingManager, at most `max_in_flight` at a time, and yields Completions."""

    def __init__(
        self,
        model,
        generation_config,
        cb_config,
        *,
        max_in_flight: int,
        max_new_tokens: int,
        num_return_sequences: int,
        eos_token_ids: set[int],
        max_positions: int | None,
        workload_hints=None,
    ) -> None:
        self.model = model
        self.generation_config = generation_config
        self.cb_config = cb_config
        self.max_in_flight = max_in_flight
        self.max_new_tokens = max_new_tokens
        self.n = num_return_sequences
        self.eos_token_ids = eos_token_ids
        self.max_positions = max_positions
        self.workload_hints = workload_hints
        self.stats = EngineStats()
        self._manager = None
        self._counter = 0

    # -------------------------------------------------------------------------------------------------------------- #
    def _start_manager(self) -> None:
        manager = self.model.init_continuous_batching(
            generation_config=self.generation_config,
            continuous_batching_config=self.cb_config,
            workload_hints=self.workload_hints,
        )
        manager.warmup()  # builds the paged cache now, so its real size is known before the first admission
        cache = getattr(manager.batch_processor, "cache", None)
        resolved = manager.continuous_batching_config
        self.stats.page_size = resolved.page_size
        self.stats.num_blocks = getattr(cache, "num_blocks", None) or resolved.num_blocks
        self.stats.resolved_config = {
            k: v for k, v in vars(resolved).items() if isinstance(v, (int, float, str, bool, tuple, type(None)))
        }
        manager.start()
        self._manager = manager

    def _stop_manager(self) -> None:
        if self._manager is None:
            return
        try:
            self._manager.stop(block=True, timeout=30)
            self._manager.destroy()
        finally:
            self._manager = None

    def never_fits(self, request: Request) -> str | None:
        """Why `request` can never run, or None. Must hold for any schedule, or the manager's loop would die."""
        length = len(request.input_ids)
        if self.max_positions is not None and length >= self.max_positions:
            return (
                f"prompt of {length} tokens does not fit the model's context of {self.max_positions} tokens; "
                "shorten the prompt"
            )
        if self.stats.num_blocks and self.stats.page_size:
            needed = ceil((length + self._max_new_for(length)) / self.stats.page_size) + 1
            if needed > self.stats.num_blocks:
                capacity = self.stats.num_blocks * self.stats.page_size
                return (
                    f"prompt of {length} tokens + {self._max_new_for(length)} new tokens can never fit in the KV cache "
                    f"({capacity} tokens); raise --num-blocks or --max-memory-percent, or lower --max-new-tokens"
                )
        return None

    def _max_new_for(self, prompt_length: int) -> int:
        """max_new_tokens, capped so prompt + generation stays within the model's context."""
        if self.max_positions is None:
            return self.max_new_tokens
        return max(1, min(self.max_new_tokens, self.max_positions - prompt_length))

    def _fail(self, request: Request, error: str) -> list[Completion]:
        return [Completion(request, i, [], None, "error", error) for i in range(self.n)]

    # -------------------------------------------------------------------------------------------------------------- #
    def run(self, requests: Iterable[Request]) -> Iterator[Completion]:
        """Yields one Completion per returned sequence of every request, in the order they finish."""
        self._start_manager()
        in_flight: dict[str, _InFlight] = {}
        source = iter(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and len(in_flight) < self.max_in_flight:
                    request = next(source, None)
                    if request is None:
                        exhausted = True
                        break
                    reason = request.error or self.never_fits(request)
                    if reason is not None:
                        yield from self._fail(request, reason)
                        continue
                    key = f"r{self._counter}"
                    self._counter += 1
                    max_new = self._max_new_for(len(request.input_ids))
                    if not self._manager.is_running():  # died on an earlier request: never feed a dead loop
                        yield from self._recover(in_flight)
                    accepted = self._manager.add_request(request.input_ids, request_id=key, max_new_tokens=max_new)
                    if accepted is None:
                        yield from self._fail(request, "the engine refused the request (it was stopping)")
                        continue
                    in_flight[key] = _InFlight(request, max_new)
                if exhausted and not in_flight:
                    return
                result = self._manager.get_result(timeout=0.05)
                if result is None:
                    if not self._manager.is_running():
                        yield from self._recover(in_flight)
                    continue
                if not result.is_finished():
                    continue
                completion = self._complete(result, in_flight)
                if completion is not None:
                    yield completion
        finally:
            self._stop_manager()

    def _complete(self, result, in_flight: dict[str, _InFlight]) -> Completion | None:
        key, _, child = result.request_id.partition(CHILD_MARK)
        entry = in_flight.get(key)
        if entry is None:  # a late result for a request already failed by a recovery
            return None
        sample_index = int(child) + 1 if child else 0
        entry.returned.add(sample_index)
        if len(entry.returned) == self.n:
            del in_flight[key]
        tokens = list(result.generated_tokens)
        logprobs = [float(x) for x in result.logprobs] if result.logprobs else None
        if result.error is not None:
            return Completion(entry.request, sample_index, tokens, logprobs, "error", str(result.error))
        if tokens and tokens[-1] in self.eos_token_ids:
            reason = "stop"
        elif len(tokens) >= entry.max_new_tokens:
            reason = "length"
        else:
            reason = "stop"
        return Completion(entry.request, sample_index, tokens, logprobs, reason)

    def _recover(self, in_flight: dict[str, _InFlight]) -> Iterator[Completion]:
        """The manager's loop has died: drain what it finished, fail the rest with its error, start a fresh one."""
        manager = self._manager
        while (result := manager.get_result(timeout=0)) is not None:
            if result.is_finished() and (completion := self._complete(result, in_flight)) is not None:
                yield completion
        fatal = getattr(manager.background_thread_status, "fatal_error", None)
        error = f"the generation loop stopped: {fatal}" if fatal else "the generation loop stopped unexpectedly"
        log.warning("%s; restarting it (%d requests in flight failed)", error, len(in_flight))
        for entry in in_flight.values():
            for i in sorted(set(range(self.n)) - entry.returned):
                yield Completion(entry.request, i, [], None, "error", error)
        in_flight.clear()
        self._stop_manager()
        self.stats.restarts += 1
        self._start_manager()
