"""Drives transformers' ContinuousBatchingManager over a stream of requests with a bounded in-flight window.

Results are yielded as they finish, so the caller writes them out while generation goes on and memory does not grow
with the input. Requests that can never run are failed before admission (cbgen.engine.admission). If the manager's
loop dies anyway, the requests in flight are failed with its error and a fresh manager carries on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cbgen.engine.admission import Limits, Placement, PrefixGate, rejection
from cbgen.engine.endings import ended
from cbgen.engine.manager import (
    CacheFacts,
    ManagerSpec,
    drain,
    live_lengths,
    loop_error,
    prefix_matches,
    start_manager,
    stop_manager,
)
from cbgen.engine.scope import EngineScope
from cbgen.engine.stops import StopStrings
from cbgen.errors import CbgenError
from cbgen.records import Completion, Request, request_key, sequence_ids

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    from cbgen.control.grammars import Grammars
    from cbgen.control.processor import StepControl
    from cbgen.model.adapters import Adapters

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class EngineSettings:
    """How the engine runs: what builds its manager, how much it keeps in flight, and what ends a sequence."""

    spec: ManagerSpec
    max_in_flight: int
    max_new_tokens: int  # the job's; a request may ask for its own
    num_return_sequences: int  # the job's; a request may ask for its own (then it runs as copies)
    eos_token_ids: frozenset[int]
    max_positions: int | None  # the model's context
    request_timeout: float | None = None
    prefix_gating: bool = True
    adapters: Adapters | None = None  # the LoRA adapters its requests run with, each merged for its group of them


@dataclass
class EngineStats:
    started: bool = False  # a manager ran (not when every request was refused before admission)
    restarts: int = 0
    num_blocks: int | None = None
    kv_resident: str | None = None  # "all at start", "as used" or "as used, returned when freed" (CacheFacts.resident)
    resolved_config: dict = field(default_factory=dict)


@dataclass
class _InFlight:
    """A request in the engine: the manager ids of its sequences and those already finished."""

    request: Request
    max_new_tokens: int
    started: float  # time.monotonic() when handed to the manager
    ids: dict[str, int] = field(default_factory=dict)  # manager id of each sequence -> its sample index
    done: dict[int, Completion] = field(default_factory=dict)  # sample index -> completion
    copies: bool = False  # its sequences run as separate manager requests (cbgen.records), not forks
    later: list[str] = field(default_factory=list)  # copies admitted once the first has computed the prompt
    stop: StopStrings | None = None
    checked: dict[int, int] = field(default_factory=dict)  # sample index -> tokens already searched for stops

    @property
    def n(self) -> int:
        return len(self.ids)

    def close_with_error(self, error: str) -> list[Completion]:
        """The sequences it finished, plus an error for each one it did not."""
        return [self.done.get(i) or Completion(self.request, i, [], None, "error", error) for i in range(self.n)]


@dataclass
class _Feed:
    source: Iterator[Request | None]
    exhausted: bool = False


_END: Any = object()  # the source has no more requests


class Engine:
    """Feeds requests to a ContinuousBatchingManager, at most `max_in_flight` at a time, and yields Completions.

    `control` runs inside each step (grammar masks, the model's own logprobs, seeded draws); `decode` turns token
    ids into text, for stop strings; `restartable`: a fresh manager takes over when the loop dies (not under tensor
    parallelism, whose other ranks cannot follow suit)."""

    def __init__(self, model: Any, settings: EngineSettings, *, control: StepControl | None = None,
                 decode: Callable[[list[int]], str] | None = None, restartable: bool = True) -> None:
        self.model = model
        self.settings = settings
        self.limits = Limits(settings.max_new_tokens, settings.max_positions)
        self.stats = EngineStats()
        self.control = control
        self.decode = decode
        self.restartable = restartable
        self._manager: ContinuousBatchingManager | None = None
        self._scope: EngineScope | None = None  # while `run` runs
        self._prefix_sharing = False
        self._page_size = 0  # the manager's, once it has started
        self._counter = 0
        self._matched: dict[str, int] = {}  # manager id -> prompt tokens served from shared KV blocks

    @property
    def manager(self) -> ContinuousBatchingManager:
        """The manager the loop drives (there is one from the first admission to the end of the run)."""
        if self._manager is None:
            raise RuntimeError("the engine has no manager running")
        return self._manager

    @classmethod
    def for_tokenizer(cls, model: Any, tokenizer: Any, settings: EngineSettings, *, grammars: Grammars | None = None,
                      restartable: bool = True) -> Engine:
        """The engine `settings` describe, its step control (if its plan has one) and stop strings working with
        `tokenizer`; `grammars`: the job's compiled formats, when this process has them already."""
        steps = settings.spec.control
        control = steps.control(tokenizer, grammars) if steps is not None else None
        return cls(model, settings, control=control, restartable=restartable,
                   decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    def run(self, requests: Iterable[Request | None], stop: threading.Event | None = None
            ) -> Iterator[list[Completion]]:
        """Yields the sequences of each request together (sorted by sample index), in the order requests finish.

        `requests` may yield None for "nothing now": a source whose next requests depend on the results of those in
        flight (a conversation's next turn, cbgen.conversations) says so, and is asked again once a result is in.
        Such a source yields None only while some of its requests are unfinished.

        When `stop` is set, no more requests are admitted and the manager is stopped at once: requests that finished
        are still yielded, unfinished ones are dropped (a resume generates them), so nothing half-done is reported.
        A request that comes with its sequences (`answered`, from the result cache) is yielded as it is, in turn.
        Everything the plan installs into transformers and torch, and every process-wide change of the run (logging,
        gc, OpenMP: cbgen.engine.scope), is in place while the engine runs, and gone when it ends. The manager (and
        its KV cache) starts only once a request that can run arrives; with adapters, a run per adapter's group of
        requests, it merged (cbgen.engine.adapters)."""
        from cbgen.engine.adapters import by_adapter

        yield from by_adapter(self.model, self.settings.adapters, requests, lambda rs: self._run(rs, stop), stop)

    def _run(self, requests: Iterable[Request | None], stop: threading.Event | None) -> Iterator[list[Completion]]:
        source = iter(requests)
        for first in source:  # answered: the result cache holds its sequences (cbgen.result_cache)
            if first is None:
                continue  # nothing now, and nothing in flight: the source's next ask has one
            if first.answered is None and first.error is None:
                break
            yield first.answered if first.answered is not None else self._reject(first, first.error or "")
        else:
            return  # nothing could run: no manager, no cache
        with EngineScope(self.model, self.settings.spec.scope) as self._scope:
            try:
                self._start()
                yield from self._loop(itertools.chain([first], source), stop or threading.Event())
            finally:
                if self._manager is not None:
                    for _ in stop_manager(self._manager):
                        pass
                    self._manager = None
                self._scope = None

    # ------------------------------------------------------------------------------------------------------------ #
    # the loop

    def _loop(self, source: Iterator[Request | None], stop: threading.Event) -> Iterator[list[Completion]]:
        gate = PrefixGate(self._page_size, max_parked=4 * self.settings.max_in_flight,
                          enabled=self.settings.prefix_gating and self._prefix_sharing)
        in_flight: dict[str, _InFlight] = {}
        feed = _Feed(source)
        while True:
            if stop.is_set():
                yield from self._stop_now(in_flight)
                return
            while len(in_flight) < self.settings.max_in_flight:
                picked = yield from self._next_admissible(feed, gate)
                if picked is None:
                    break
                request, lead = picked
                if not self.manager.is_running():  # died on an earlier request: never feed a dead loop
                    yield from self._recover(in_flight, gate)
                yield from self._admit(request, lead, in_flight, gate)
            if feed.exhausted and not in_flight and not gate.waiting:
                return
            if self.settings.request_timeout is not None:
                yield from self._expire(in_flight, gate)
            yield from self._collect(in_flight, gate)

    def _next_admissible(self, feed: _Feed, gate: PrefixGate):
        """The next request to admit and whether it leads its prefix, or None when none can go now. Yields the
        requests it fails on the way (those that can never run)."""
        if gate.ready:
            return gate.ready.popleft(), False
        while not feed.exhausted and not gate.full:
            request = next(feed.source, _END)
            if request is _END:
                feed.exhausted = True
                return None
            if request is None:  # nothing now: more may follow once a request in flight finishes
                return None
            reason = None if request.answered is not None else request.error or self.limits.never_fits(request)
            if request.answered is not None or reason is not None:
                yield request.answered if request.answered is not None else self._reject(request, reason or "")
                continue
            placement = gate.place(request)
            if placement is not Placement.PARKED:
                return request, placement is Placement.LEADER
        return None

    def _collect(self, in_flight: dict[str, _InFlight], gate: PrefixGate) -> Iterator[list[Completion]]:
        """Waits briefly for one result (the caller's idle OpenMP workers freed first: cbgen.engine.openmp) and yields
        the request it completes, if any."""
        assert self._scope is not None
        self._scope.release_caller_pool()
        result = self.manager.get_result(timeout=0.05)
        if result is None:
            if not self.manager.is_running():
                yield from self._recover(in_flight, gate)
            return
        key = request_key(result.request_id)
        if result.generated_tokens or result.is_finished():
            gate.prefix_computed(key)  # its first token exists: all its prompt's blocks do too
            self._admit_later(key, in_flight)
        if (group := self._complete(result, in_flight)) is not None:
            yield group

    # ------------------------------------------------------------------------------------------------------------ #
    # the manager

    def live(self) -> list[int]:
        """The tokens generated so far by each unfinished sequence (cbgen.progress.pace); callable from any thread."""
        manager = self._manager
        return live_lengths(manager) if manager is not None else []

    def _start(self) -> None:
        assert self._scope is not None
        self._manager, facts = start_manager(self.model, self.settings.spec, self._scope, self.control)
        self._matched = prefix_matches(self._manager)
        self.stats.started = True
        self._record(facts)

    def _record(self, facts: CacheFacts) -> None:
        self.limits.num_blocks, self.limits.page_size = facts.num_blocks, facts.page_size
        self._page_size = facts.page_size
        self._prefix_sharing = facts.prefix_sharing
        self.stats.num_blocks = facts.num_blocks
        self.stats.kv_resident = facts.resident
        self.stats.resolved_config = facts.resolved_config

    def _stop_now(self, in_flight: dict[str, _InFlight]) -> Iterator[list[Completion]]:
        """Stops the manager at once and yields the requests that had finished all their sequences."""
        manager, self._manager = self.manager, None
        for result in stop_manager(manager, hard=True):
            # a hard stop fails what was running: those requests are left for a resume, not reported as failed
            if result.is_finished() and result.error is None and (group := self._complete(result, in_flight)):
                yield group
        in_flight.clear()
        if self.control is not None:
            self.control.forget_all()

    def _recover(self, in_flight: dict[str, _InFlight], gate: PrefixGate) -> Iterator[list[Completion]]:
        """The manager's loop has died: take what it finished, fail the rest with its error, start a fresh one."""
        for result in drain(self.manager):
            if result.is_finished() and (group := self._complete(result, in_flight)) is not None:
                yield group
        error = loop_error(self.manager)
        if not self.restartable:
            raise CbgenError(f"{error}; under tensor parallelism the job stops here (run it again to resume)")
        log.warning("%s; restarting it (%d requests in flight failed)", error, len(in_flight))
        for key in list(in_flight):
            gate.prefix_computed(key)
            yield in_flight.pop(key).close_with_error(error)
        if self.control is not None:
            self.control.forget_all()
        manager, self._manager = self.manager, None
        for _ in stop_manager(manager):
            pass
        self.stats.restarts += 1
        self._start()

    # ------------------------------------------------------------------------------------------------------------ #
    # requests

    def _reject(self, request: Request, error: str) -> list[Completion]:
        return rejection(request, error, request.n or self.settings.num_return_sequences)

    def _admit(self, request: Request, lead: bool, in_flight: dict[str, _InFlight], gate: PrefixGate):
        """Hands one request to the manager. A leader streams, so its first token tells when its prefix is cached;
        so do requests with stop strings, checked token by token. A request asking for another number of sequences
        than the job (only when the job asks for one) runs as that many copies: the first one computes the prompt,
        the others follow once it is cached."""
        key = f"r{self._counter}"
        self._counter += 1
        entry = _InFlight(request, self.limits.max_new_for(request), time.monotonic())
        n, job_n = request.n or self.settings.num_return_sequences, self.settings.num_return_sequences
        # transformers forks a request's sequences before its prompt's last token, so a one-token prompt would run a
        # step of no tokens, which kills the loop (transformers 5.23): such a prompt's sequences run as copies
        entry.copies = n != job_n or (n > 1 and len(request.ids) < 2)
        entry.ids = sequence_ids(key, n, copies=entry.copies)
        if not entry.copies:
            first = [key]
        else:
            first = list(entry.ids)[:1] if self._prefix_sharing else list(entry.ids)
            entry.later = [i for i in entry.ids if i not in first]
        if request.stop:
            if self.decode is None:
                raise CbgenError("a request has stop strings, but the engine was given no way to decode tokens")
            entry.stop = StopStrings(request.stop, self.decode)
        for manager_id in first:
            if not self._add(entry, manager_id, streaming=lead or bool(entry.later)):
                yield self._reject(request, "the engine refused the request (it was stopping)")
                if lead:
                    gate.prefix_computed(key)
                return
        if lead:
            gate.lead(request, key)
        in_flight[key] = entry

    def _add(self, entry: _InFlight, manager_id: str, streaming: bool) -> bool:
        request, manager = entry.request, self.manager
        assert self._scope is not None
        # copies: one sequence each (the manager forks every request it is given into the job's n; add_request alone
        # reads it, in this thread)
        with self._scope.forking(1 if entry.copies else None):
            accepted = manager.add_request(request.ids, request_id=manager_id, max_new_tokens=entry.max_new_tokens,
                                           streaming=streaming or entry.stop is not None, **request.sampling)
        return accepted is not None

    def _admit_later(self, key: str, in_flight: dict[str, _InFlight]) -> None:
        """The first copy of `key` has computed its prompt: the other copies go now and share its KV blocks."""
        entry = in_flight.get(key)
        if entry is None or not entry.later:
            return
        later, entry.later = entry.later, []
        for manager_id in later:
            self._add(entry, manager_id, streaming=False)

    def _complete(self, result, in_flight: dict[str, _InFlight]) -> list[Completion] | None:
        """Records a sequence that finished (or reached a stop string); returns the request's sequences once all of
        them are in."""
        key = request_key(result.request_id)
        entry = in_flight.get(key)
        if entry is None:  # a late result for a request already failed (recovery) or cancelled (timeout)
            return None
        sample_index = entry.ids.get(result.request_id)
        if sample_index is None or sample_index in entry.done:
            return None  # a sequence already ended by a stop string: what it streamed after is not wanted
        stopped = None
        tokens = list(result.generated_tokens)
        if entry.stop is not None and result.error is None:
            stopped = entry.stop.find(tokens, entry.checked.get(sample_index, 0), hold=entry.request.min_tokens)
            entry.checked[sample_index] = len(tokens)
        if stopped is None and not result.is_finished():
            return None  # a streamed step
        if stopped is not None and not result.is_finished():
            self.manager.cancel_request(result.request_id)
        completion = ended(entry.request, sample_index, result, tokens, stopped, self.control,
                           eos_token_ids=self.settings.eos_token_ids, max_new_tokens=entry.max_new_tokens)
        completion.num_cached_tokens = self._matched.pop(result.request_id, 0)
        entry.done[sample_index] = completion
        if len(entry.done) < entry.n:
            return None
        del in_flight[key]
        return [entry.done[i] for i in range(entry.n)]

    def _expire(self, in_flight: dict[str, _InFlight], gate: PrefixGate) -> Iterator[list[Completion]]:
        """Cancels requests that have run longer than --request-timeout. The manager returns nothing for a
        cancelled request, so cbgen records the failure itself."""
        now, timeout = time.monotonic(), self.settings.request_timeout
        if timeout is None:
            return
        for key, entry in list(in_flight.items()):
            if now - entry.started <= timeout:
                continue
            for manager_id, sample in entry.ids.items():
                if sample not in entry.done and manager_id not in entry.later:
                    self.manager.cancel_request(manager_id)
                if self.control is not None:
                    self.control.take(manager_id)
            gate.prefix_computed(key)  # or not: its followers go ahead and compute it themselves
            yield in_flight.pop(key).close_with_error(f"timed out after {timeout:g} s (--request-timeout)")
