"""Drives transformers' ContinuousBatchingManager over a stream of requests with a bounded in-flight window.

Results are yielded as they finish, so the caller writes them out while generation goes on and memory does not grow
with the input. Requests that can never run (longer than the model's context, or than the KV cache can ever hold)
are failed here, before admission: inside the manager they would stop the generation loop for every request. If
the loop dies anyway, the requests in flight are failed with its error and a fresh manager carries on.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from math import ceil

from cbgen.attention import per_sequence_attention
from cbgen.errors import CbgenError
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
    text: str | None = None  # set when a stop string cut the text; else the tokens decode to it
    rejected: bool = False  # failed before reaching the engine: the request itself is bad (or too long)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.input_ids or [])


COPY_MARK = "~copy"  # cbgen's own suffix for the separate sequences of a request whose n differs from the job's


def request_key(manager_id: str) -> str:
    """The engine's key of a request, from the id the manager knows one of its sequences by."""
    return manager_id.partition(CHILD_MARK)[0].partition(COPY_MARK)[0]


class StopStrings:
    """Finds where a sequence reaches one of its stop strings, decoding only a window of recent tokens per step."""

    def __init__(self, stops: tuple[str, ...], decode) -> None:
        self.stops = stops
        self.decode = decode
        # a token decodes to at least one byte: this many tokens hold any stop string, with room for merges
        self.window = 4 * max(len(s.encode("utf-8")) for s in stops) + 4

    def find(self, tokens: list[int], start: int) -> tuple[int, str] | None:
        """The first k > start such that tokens[:k] show a stop string, with the text cut before it; or None."""
        for k in range(max(start, 0) + 1, len(tokens) + 1):
            tail = self.decode(tokens[max(0, k - self.window):k])
            if any(stop in tail for stop in self.stops):
                text = self.decode(tokens[:k])
                cut = min((i for i in (text.find(stop) for stop in self.stops) if i >= 0), default=len(text))
                return k, text[:cut]
        return None


@dataclass
class _InFlight:
    request: Request
    max_new_tokens: int
    started: float  # time.monotonic() when handed to the manager
    ids: dict[str, int] = field(default_factory=dict)  # manager id of each sequence -> its sample index
    done: dict[int, Completion] = field(default_factory=dict)  # sample index -> completion
    later: list[str] = field(default_factory=list)  # copies admitted once the first has computed the prompt
    stop: StopStrings | None = None
    checked: dict[int, int] = field(default_factory=dict)  # sample index -> tokens already searched for stops

    @property
    def n(self) -> int:
        return len(self.ids)


class Placement(enum.Enum):
    ALONE = "alone"  # nothing to share, or its prefix is cached already
    LEADER = "leader"  # the first of its prefix: computes it
    PARKED = "parked"  # waits until its leader has computed the prefix


class PrefixGate:
    """Admits the first request of each shared prefix and holds back the others until it has computed that prefix.

    The engine reuses a prefix's KV blocks only once they are computed. Requests sharing a prefix that are admitted
    together (what a sorted submission does) all compute it themselves, so followers wait here, at most `max_parked`
    of them, and go as soon as their leader's first token exists. A prefix is the first `key_tokens` tokens (one
    KV page: shorter prompts have no complete block to share). Prefixes seen computed are remembered (bounded), so
    later requests sharing them go straight in; if the engine has evicted those blocks meanwhile, they recompute.
    """

    def __init__(self, key_tokens: int, max_parked: int, enabled: bool = True, memory: int = 65536) -> None:
        self.key_tokens = key_tokens
        self.max_parked = max_parked
        self.enabled = enabled
        self.memory = memory
        self.ready: deque[Request] = deque()  # released followers, admitted before anything new
        self.waiting: dict[tuple[int, ...], list[Request]] = {}  # prefix -> parked followers
        self._leaders: dict[str, tuple[int, ...]] = {}  # request key -> the prefix it computes
        self._computing: set[tuple[int, ...]] = set()
        self._computed: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._parked = 0

    @property
    def full(self) -> bool:
        return self._parked >= self.max_parked

    def place(self, request: Request) -> Placement:
        prefix = self._prefix(request)
        if prefix is None or prefix in self._computed:
            return Placement.ALONE
        if prefix in self._computing:
            self.waiting.setdefault(prefix, []).append(request)
            self._parked += 1
            return Placement.PARKED
        return Placement.LEADER

    def lead(self, request: Request, key: str) -> None:
        """`request`, placed as a LEADER, is in the engine under `key`."""
        prefix = self._prefix(request)
        self._leaders[key] = prefix
        self._computing.add(prefix)

    def prefix_computed(self, key: str) -> None:
        """The request `key` has produced a token (or ended): release the followers of its prefix."""
        prefix = self._leaders.pop(key, None)
        if prefix is None:
            return
        self._computing.discard(prefix)
        self._computed[prefix] = None
        if len(self._computed) > self.memory:
            self._computed.popitem(last=False)
        followers = self.waiting.pop(prefix, [])
        self._parked -= len(followers)
        self.ready.extend(followers)

    def _prefix(self, request: Request) -> tuple[int, ...] | None:
        if not self.enabled or len(request.input_ids) <= self.key_tokens:
            return None
        return tuple(request.input_ids[: self.key_tokens])


@dataclass
class EngineStats:
    restarts: int = 0
    num_blocks: int | None = None
    page_size: int | None = None
    prefix_sharing: bool = False
    attention: str = "stock"
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
        request_timeout: float | None = None,
        prefix_gating: bool = True,
        per_sequence_attention: str = "auto",
        decode=None,
        restartable: bool = True,
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
        self.request_timeout = request_timeout
        self.prefix_gating = prefix_gating
        self.per_sequence_attention = per_sequence_attention  # "auto" (where it applies), "required" or "off"
        self.decode = decode  # token ids -> text, for stop strings
        # a fresh manager after a loop death; not under tensor parallelism, whose other ranks cannot follow suit
        self.restartable = restartable
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
        # block sharing is only ever allowed: the cache turns it off for models with sliding-window layers
        self.stats.prefix_sharing = bool(getattr(cache, "use_prefix_sharing", resolved.allow_block_sharing))
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
            needed = ceil((length + self._max_new_for(request)) / self.stats.page_size) + 1
            if needed > self.stats.num_blocks:
                capacity = self.stats.num_blocks * self.stats.page_size
                return (
                    f"prompt of {length} tokens + {self._max_new_for(request)} new tokens can never fit in the KV "
                    "cache "
                    f"({capacity} tokens); raise --num-blocks or --max-memory-percent, or lower --max-new-tokens"
                )
        return None

    def _max_new_for(self, request: Request) -> int:
        """The request's max_new_tokens (its own, else the job's), capped so prompt + generation stays within the
        model's context."""
        cap = request.max_new_tokens or self.max_new_tokens
        if self.max_positions is None:
            return cap
        return max(1, min(cap, self.max_positions - len(request.input_ids)))

    def _n_for(self, request: Request) -> int:
        return request.n or self.n

    def _fail(self, request: Request, error: str) -> list[Completion]:
        """Fails a request that never reached the engine; the error names the input line or row."""
        error = f"{request.record.location}: {error}"
        return [Completion(request, i, [], None, "error", error, rejected=True) for i in range(self._n_for(request))]

    # -------------------------------------------------------------------------------------------------------------- #
    def run(self, requests: Iterable[Request], stop: threading.Event | None = None) -> Iterator[list[Completion]]:
        """Yields the sequences of each request together (sorted by sample index), in the order requests finish.

        When `stop` is set, no more requests are admitted and the manager is stopped at once: requests that finished
        are still yielded, unfinished ones are dropped (a resume generates them), so nothing half-done is reported.
        On CPU, attention runs per sequence while the engine runs, where the model allows it (cbgen.attention).
        """
        if self.per_sequence_attention == "off":
            attention = nullcontext(False)
        else:
            attention = per_sequence_attention(self.model, required=self.per_sequence_attention == "required")
        with attention as active:  # around the manager's whole life: its thread looks the function up every step
            self.stats.attention = "per-sequence" if active else "stock"
            yield from self._run(requests, stop)

    def _run(self, requests: Iterable[Request], stop: threading.Event | None) -> Iterator[list[Completion]]:
        self._start_manager()
        gate = PrefixGate(self.stats.page_size or 256, max_parked=4 * self.max_in_flight,
                          enabled=self.prefix_gating and self.stats.prefix_sharing)
        in_flight: dict[str, _InFlight] = {}
        source = iter(requests)
        exhausted = False
        try:
            while True:
                if stop is not None and stop.is_set():
                    yield from self._stop_now(in_flight)
                    return
                while len(in_flight) < self.max_in_flight:
                    if gate.ready:
                        request, lead = gate.ready.popleft(), False
                    elif exhausted or gate.full:
                        break
                    else:
                        request = next(source, None)
                        if request is None:
                            exhausted = True
                            break
                        reason = request.error or self.never_fits(request)
                        if reason is not None:
                            yield self._fail(request, reason)
                            continue
                        placement = gate.place(request)
                        if placement is Placement.PARKED:
                            continue
                        lead = placement is Placement.LEADER
                    if not self._manager.is_running():  # died on an earlier request: never feed a dead loop
                        yield from self._recover(in_flight, gate)
                    yield from self._admit(request, lead, in_flight, gate)
                if exhausted and not in_flight and not gate.waiting:
                    return
                if self.request_timeout is not None:
                    yield from self._expire(in_flight, gate)
                result = self._manager.get_result(timeout=0.05)
                if result is None:
                    if not self._manager.is_running():
                        yield from self._recover(in_flight, gate)
                    continue
                key = request_key(result.request_id)
                if result.generated_tokens or result.is_finished():
                    gate.prefix_computed(key)  # its first token exists: all its prompt's blocks do too
                    self._admit_later(key, in_flight)
                if (group := self._complete(result, in_flight)) is not None:
                    yield group
        finally:
            self._stop_manager()

    def _admit(self, request: Request, lead: bool, in_flight: dict[str, _InFlight], gate: PrefixGate):
        """Hands one request to the manager. A leader streams, so its first token tells when its prefix is cached;
        so do requests with stop strings, checked token by token. A request asking for another number of sequences
        than the job (only when the job asks for one) runs as that many copies: the first one computes the prompt,
        the others follow once it is cached."""
        key = f"r{self._counter}"
        self._counter += 1
        entry = _InFlight(request, self._max_new_for(request), time.monotonic())
        n = self._n_for(request)
        if n == self.n:
            entry.ids = {key: 0} | {f"{key}{CHILD_MARK}{k}": k + 1 for k in range(n - 1)}
            first = [key]
        else:
            entry.ids = {f"{key}{COPY_MARK}{j}": j for j in range(n)}
            first = list(entry.ids)[:1] if self.stats.prefix_sharing else list(entry.ids)
            entry.later = [i for i in entry.ids if i not in first]
        if request.stop:
            entry.stop = StopStrings(request.stop, self.decode)
        for manager_id in first:
            if not self._add(entry, manager_id, streaming=lead or bool(entry.later)):
                yield self._fail(request, "the engine refused the request (it was stopping)")
                if lead:
                    gate.prefix_computed(key)
                return
        if lead:
            gate.lead(request, key)
        in_flight[key] = entry

    def _add(self, entry: _InFlight, manager_id: str, streaming: bool) -> bool:
        request = entry.request
        accepted = self._manager.add_request(request.input_ids, request_id=manager_id,
                                             max_new_tokens=entry.max_new_tokens,
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
        tokens = list(result.generated_tokens)
        logprobs = [float(x) for x in result.logprobs] if result.logprobs else None
        text = None
        stopped = None
        if entry.stop is not None and result.error is None:
            stopped = entry.stop.find(tokens, entry.checked.get(sample_index, 0))
            entry.checked[sample_index] = len(tokens)
        if stopped is not None:
            cut, text = stopped
            tokens, logprobs = tokens[:cut], logprobs[:cut] if logprobs else logprobs
            reason, error = "stop", None
            if not result.is_finished():
                self._manager.cancel_request(result.request_id)
        elif not result.is_finished():
            return None  # a streamed step
        elif result.error is not None:
            reason, error = "error", str(result.error)
        elif tokens and tokens[-1] in self.eos_token_ids:
            reason, error = "stop", None
        elif len(tokens) >= entry.max_new_tokens:
            reason, error = "length", None
        else:
            reason, error = "stop", None
        entry.done[sample_index] = Completion(entry.request, sample_index, tokens, logprobs, reason, error, text)
        if len(entry.done) < entry.n:
            return None
        del in_flight[key]
        return [entry.done[i] for i in range(entry.n)]

    def _close_with_error(self, key: str, in_flight: dict[str, _InFlight], error: str) -> list[Completion]:
        """Ends a request now: the sequences it finished, plus an error for each one it did not."""
        entry = in_flight.pop(key)
        return [
            entry.done.get(i) or Completion(entry.request, i, [], None, "error", error) for i in range(entry.n)
        ]

    def _expire(self, in_flight: dict[str, _InFlight], gate: PrefixGate) -> Iterator[list[Completion]]:
        """Cancels requests that have run longer than --request-timeout. The manager returns nothing for a
        cancelled request, so cbgen records the failure itself."""
        now = time.monotonic()
        for key, entry in list(in_flight.items()):
            if now - entry.started <= self.request_timeout:
                continue
            for manager_id, sample in entry.ids.items():
                if sample not in entry.done and manager_id not in entry.later:
                    self._manager.cancel_request(manager_id)
            error = f"timed out after {self.request_timeout:g} s (--request-timeout)"
            gate.prefix_computed(key)  # or not: its followers go ahead and compute it themselves
            yield self._close_with_error(key, in_flight, error)

    def _stop_now(self, in_flight: dict[str, _InFlight]) -> Iterator[list[Completion]]:
        """Stops the manager at once and yields the requests that had finished all their sequences."""
        manager, self._manager = self._manager, None
        manager.stop(block=True, timeout=20, hard_stop=True)
        while (result := manager.get_result(timeout=0)) is not None:
            # a hard stop fails what was running: those requests are left for a resume, not reported as failed
            if result.is_finished() and result.error is None and (group := self._complete(result, in_flight)):
                yield group
        manager.destroy()
        in_flight.clear()

    def _recover(self, in_flight: dict[str, _InFlight], gate: PrefixGate) -> Iterator[list[Completion]]:
        """The manager's loop has died: take what it finished, fail the rest with its error, start a fresh one."""
        manager = self._manager
        while (result := manager.get_result(timeout=0)) is not None:
            if result.is_finished() and (group := self._complete(result, in_flight)) is not None:
                yield group
        fatal = getattr(manager.background_thread_status, "fatal_error", None)
        error = f"the generation loop stopped: {fatal}" if fatal else "the generation loop stopped unexpectedly"
        if not self.restartable:
            raise CbgenError(f"{error}; under tensor parallelism the job stops here (run it again to resume)")
        log.warning("%s; restarting it (%d requests in flight failed)", error, len(in_flight))
        for key in list(in_flight):
            gate.prefix_computed(key)
            yield self._close_with_error(key, in_flight, error)
        self._stop_manager()
        self.stats.restarts += 1
        self._start_manager()
