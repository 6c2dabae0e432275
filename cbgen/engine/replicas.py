"""`--data-parallel N`: N engine processes on this node, each with its own copy of the model and its own share of
the CPU cores (threads split and pinned) or its own GPU. The main process stays the one reader, renderer and
writer, so a job keeps one output directory, resume, progress, exit codes and run.json.

Work is demand-driven: a replica asks for a request whenever its engine has room, and the main process answers with
the next one in order; no replica holds a queue while another idles. A replica that dies has the requests it held
given once more to the others (a second loss records them as failed), and the job goes on; the summary names it.
A stop (SIGTERM) stops every replica at once: what finished is written, and a rerun resumes.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from cbgen.config import JobConfig, ModelSection
from cbgen.engine.engine import EngineStats
from cbgen.errors import CbgenError
from cbgen.records import Completion, Request

if TYPE_CHECKING:
    from cbgen.engine.job_plan import JobPlan

EXIT = "exit"


def cpu_groups(replicas: int, cpus: list[int] | None = None) -> list[list[int]]:
    """This process's CPUs split into `replicas` contiguous groups (the first ones one larger when uneven)."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if replicas > len(cpus):
        raise CbgenError(f"--data-parallel {replicas} needs at least {replicas} CPU cores; this process may use "
                         f"{len(cpus)}")
    size, extra = divmod(len(cpus), replicas)
    groups, start = [], 0
    for i in range(replicas):
        end = start + size + (1 if i < extra else 0)
        groups.append(cpus[start:end])
        start = end
    return groups


def visible_gpus(count: int) -> list[str]:
    """The `count` GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (indices, GPU-/MIG- UUIDs), so that a
    replica given some of them sees those and not the machine's first ones; indices 0..count-1 where it is unset."""
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in names.split(",") if name.strip()][:count]


def gpu_groups(replicas: int, tp: int, visible: list[str]) -> list[list[str]]:
    """The GPUs of each replica, as names for its CUDA_VISIBLE_DEVICES: `tp` consecutive ones of the `visible` ones
    each; exits 2 (CbgenError) when they do not fit."""
    if replicas * tp > len(visible):
        raise CbgenError(f"--data-parallel {replicas} x --tp {tp} needs {replicas * tp} GPUs; {len(visible)} are "
                         "visible")
    return [visible[i * tp:(i + 1) * tp] for i in range(replicas)]


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What one replica process needs to build the engine the main process planned: the job's plan itself."""

    index: int
    model: ModelSection
    plan: JobPlan
    cpus: list[int] | None
    gpus: list[str] | None  # its CUDA_VISIBLE_DEVICES, within the main process's


def _receive(inbox, parent: int):
    """The main process's next message; exits when the main process is gone (killed: nobody will ever answer)."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                os._exit(1)


def _serve(spec: ReplicaSpec, inbox, outbox, stop) -> None:
    """A replica process: loads the model, then runs its engine over requests it asks the main process for."""
    import signal

    parent = os.getppid()
    # the main process decides when to stop (SIGTERM, Ctrl-C to the process group) and tells every replica
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if spec.gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
        os.environ["OMP_NUM_THREADS"] = str(len(spec.cpus))
    try:
        import torch

        if spec.cpus:
            torch.set_num_threads(len(spec.cpus))
        from cbgen.engine.engine import Engine
        from cbgen.model.load import load_model

        loaded = load_model(spec.model)
        engine = Engine.for_tokenizer(loaded.model, loaded.tokenizer, spec.plan.engine.settings)
    except Exception as e:  # noqa: BLE001 - told to the main process, which names the replica
        outbox.put(("failed", spec.index, f"{type(e).__name__}: {e}"[:500]))
        return
    done = False
    while not done:
        outbox.put(("want", spec.index, "first"))  # a new round: the main process answers when it has work
        first = _receive(inbox, parent)
        if first == EXIT:
            break

        def requests(first=first) -> Iterator[Request]:
            nonlocal done
            item = first
            while item is not None:
                yield item
                outbox.put(("want", spec.index, "next"))  # answered at once: a request, or None for "no more now"
                item = _receive(inbox, parent)
                if item == EXIT:
                    done = True
                    return

        for group in engine.run(requests(), stop):
            outbox.put(("done", spec.index, group))
        done = done or stop.is_set()
    outbox.put(("stats", spec.index, engine.stats))


class ReplicaPool:
    """Runs requests on N replica processes; the same interface as Engine (`run`, `stats`)."""

    def __init__(self, specs: list[ReplicaSpec]) -> None:
        import multiprocessing

        self.specs = specs
        self.stats = EngineStats()
        self.lost: dict[int, str] = {}  # replica -> why it was lost
        self._context = multiprocessing.get_context("spawn")  # never fork a process that holds torch threads

    def live(self) -> list[int]:
        """Unfinished sequences' tokens: the replicas do not report theirs, so progress counts finished ones."""
        return []

    def run(self, requests: Iterable[Request], stop: threading.Event | None = None) -> Iterator[list[Completion]]:
        stop = stop or threading.Event()
        ctx = self._context
        outbox, halt = ctx.Queue(), ctx.Event()
        inboxes = [ctx.Queue() for _ in self.specs]
        processes = [ctx.Process(target=_serve, args=(spec, inboxes[i], outbox, halt), daemon=True,
                                 name=f"cbgen-replica-{i}") for i, spec in enumerate(self.specs)]
        for process in processes:
            process.start()
        answered: deque[list[Completion]] = deque()  # found in the result cache: yielded here, never sent
        work = _Dispatch(self, _unanswered(requests, answered), inboxes, processes, halt)
        try:
            while work.live:
                while answered:
                    yield answered.popleft()
                if stop.is_set():
                    work.halt()
                try:
                    kind, index, payload = outbox.get(timeout=0.2)
                except queue.Empty:
                    yield from work.check()
                else:
                    if kind == "want":
                        work.want(index, payload)
                    elif kind == "done":
                        work.held[index].pop(payload[0].request.record.id, None)
                        yield payload
                    elif kind == "stats":
                        self._merge_stats(payload)
                    elif kind == "failed":
                        self.lost[index] = payload
                work.finish_when_idle(outbox)
        finally:
            halt.set()
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
        while answered:
            yield answered.popleft()
        if self.lost and len(self.lost) == len(processes):
            raise CbgenError(f"every replica was lost: {'; '.join(f'{i}: {why}' for i, why in self.lost.items())}")

    def _merge_stats(self, stats: EngineStats) -> None:
        self.stats.started = self.stats.started or stats.started
        self.stats.restarts += stats.restarts
        self.stats.num_blocks = stats.num_blocks
        self.stats.kv_resident = stats.kv_resident
        self.stats.resolved_config = stats.resolved_config


def pool_for(job: JobConfig, device: str, plan: JobPlan) -> ReplicaPool:
    """The replicas of a job on this node (on `device`), each building the engine of the job's `plan`."""
    count = job.run.data_parallel
    if job.model.tp_size > 1:
        raise CbgenError("--data-parallel with --tp is not supported yet: use one of them")
    cpus: list[list[int] | None]
    gpus: list[list[str] | None]
    if device == "cpu":
        cpus, gpus = list(cpu_groups(count)), [None] * count
    else:
        import torch

        cpus, gpus = [None] * count, list(gpu_groups(count, 1, visible_gpus(torch.cuda.device_count())))
    return ReplicaPool([ReplicaSpec(i, job.model, plan, cpus[i], gpus[i]) for i in range(count)])


def _unanswered(requests: Iterable[Request], answered: deque[list[Completion]]) -> Iterator[Request]:
    """The requests a replica must run; those the result cache answered go to `answered` on the way."""
    for request in requests:
        if request.answered is not None:
            answered.append(request.answered)
        else:
            yield request


class _Dispatch:
    """The main process's side of a pool's run: who holds which request, what waits for a retry, who waits for
    work. Replicas ask ("want"); a request goes to the asker, a retry first."""

    def __init__(self, pool: ReplicaPool, source: Iterator[Request], inboxes, processes, halt) -> None:
        self.pool, self.source, self.inboxes, self.processes, self.halted = pool, source, inboxes, processes, halt
        self.retry: deque[Request] = deque()
        self.held: dict[int, dict[str, Request]] = {i: {} for i in range(len(processes))}  # replica -> out
        self.retried: set[str] = set()
        self.parked: list[int] = []  # replicas waiting for a new round while there is no work
        self.exhausted = self.finished = False
        self.live = set(range(len(processes)))

    def halt(self) -> None:
        """Stop: every replica's engine stops at once (what finished still comes back), then it exits."""
        if self.halted.is_set():
            return
        self.halted.set()
        for i in self.parked:
            self.inboxes[i].put(EXIT)
        self.parked.clear()

    def want(self, index: int, when: str) -> None:
        """A replica has room: at the start of a round ("first", parked when there is no work) or within one
        ("next", answered at once, None meaning no more for now)."""
        if self.halted.is_set():
            self.inboxes[index].put(EXIT)
            return
        item = self.retry.popleft() if self.retry else None
        if item is None and not self.exhausted:
            item = next(self.source, None)
            self.exhausted = item is None
        if item is not None or when == "next":
            self._give(index, item)
        else:
            self.parked.append(index)

    def _give(self, index: int, item: Request | None) -> None:
        if item is not None:
            self.held[index][item.record.id] = item
            self.pool.stats.started = True
        self.inboxes[index].put(item)

    def check(self) -> Iterator[list[Completion]]:
        """Replicas that died: their requests go to the others once, then are recorded as failed (when the job is
        stopping or done, replicas exit and nothing is retried)."""
        from cbgen.engine.admission import rejection

        ending = self.halted.is_set() or self.finished
        for i in sorted(self.live):
            if self.processes[i].is_alive():
                continue
            self.live.discard(i)
            self._note_exit(i)
            if ending:
                continue
            for request in self.held[i].values():
                if request.record.id in self.retried:
                    yield rejection(request, f"lost with replica {i} after a first retry", request.n or 1)
                else:
                    self.retried.add(request.record.id)
                    self.retry.append(request)
            self.held[i].clear()
        while self.parked and self.retry and not ending:
            self._give(self.parked.pop(), self.retry.popleft())

    def finish_when_idle(self, outbox) -> None:
        """Once every request is answered, every replica is told to exit; the run ends when they have."""
        idle = not self.retry and not any(self.held.values()) and (self.exhausted or self.halted.is_set())
        if idle and not self.finished:
            self.finished = True
            for i in self.live:
                self.inboxes[i].put(EXIT)
            self.parked.clear()
        if self.finished:
            for i in [i for i in self.live if not self.processes[i].is_alive() and outbox.empty()]:
                self.live.discard(i)
                self._note_exit(i)

    def _note_exit(self, index: int) -> None:
        """A replica process has ended: lost, when it did not exit as told (killed, crashed), whatever it held."""
        code = self.processes[index].exitcode
        if code != 0:
            self.pool.lost.setdefault(index, f"exited with code {code}")
