"""Whether a figure was taken on a quiet machine: what other processes (and the hypervisor) took of the cores this
process runs on, before and while a path was timed.

On a 2-core machine a second job halves the cores, and a ratio measured beside it means nothing: one bench run next
to another job read cbgen at 0.45x stock `generate_batch`. So every timed path of the suite is watched: Linux's
/proc/stat counts the CPU time of every core this process may run on (busy, idle, and stolen by the hypervisor), and
`os.times()` counts this process's own (its threads, and the children it has waited for); what the cores did beyond
that was someone else's. A window is busy when others kept more than `OTHER_SHARE` of the cores busy on average, or
the hypervisor stole more than `STEAL_SHARE` of their time.

Torch-free; where /proc/stat cannot be read (not Linux) nothing is measured, and a reading says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OTHER_SHARE = 0.10  # others' average share of this process's cores above which a window is busy
STEAL_SHARE = 0.05  # the hypervisor's share of their time above which it is busy
BEFORE_SECONDS = 0.3  # the quiet moment sampled before each timed path
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")


def _cores() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Snapshot:
    """CPU seconds so far: the watched cores' busy and stolen time (/proc/stat), and this process's own."""

    wall: float
    busy: float
    steal: float
    own: float
    cores: int


def snapshot() -> Snapshot | None:
    """The counters now, or None where /proc/stat cannot be read."""
    cores = _cores()
    try:
        lines = (_PROC / "stat").read_text().splitlines()
    except OSError:
        return None
    busy = steal = 0.0
    counted = 0
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        ticks = [int(v) for v in values]
        # user nice system idle iowait irq softirq steal (guest time is already inside user)
        busy += ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]
        steal += ticks[7] if len(ticks) > 7 else 0
        counted += 1
    if not counted:
        return None
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    return Snapshot(time.monotonic(), busy / _TICK, steal / _TICK, own, counted)


@dataclass(frozen=True)
class Load:
    """What others took of this process's cores over `seconds` of wall time: `other` and `steal` are shares of the
    cores' time (0.5: one core of two)."""

    seconds: float
    cores: int
    other: float
    steal: float

    @property
    def busy(self) -> bool:
        return self.other > OTHER_SHARE or self.steal > STEAL_SHARE

    def describe(self) -> str:
        what = (f"other processes kept {self.other:.0%} of the {self.cores} cores busy and the hypervisor stole "
                f"{self.steal:.0%} of their time over {self.seconds:.1f} s")
        return f"busy: {what}" if self.busy else f"quiet: {what}"

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 2), "other_share": round(self.other, 3),
                "steal_share": round(self.steal, 3), "busy": self.busy}


def between(start: Snapshot, end: Snapshot) -> Load:
    """The load of the window from `start` to `end` (each process's counters tick at their own resolution, so a
    small negative share is rounding and counts as none)."""
    wall = max(end.wall - start.wall, 1e-6)
    capacity = wall * end.cores
    others = (end.busy - start.busy) - (end.own - start.own)
    return Load(wall, end.cores, max(0.0, others / capacity), max(0.0, (end.steal - start.steal) / capacity))


def sample(seconds: float = BEFORE_SECONDS) -> Load | None:
    """The load over the next `seconds`, this process sleeping: what others do on a machine left to them."""
    start = snapshot()
    time.sleep(seconds)
    end = snapshot()
    return None if start is None or end is None else between(start, end)


class Watch:
    """The load before and during one timed path: `before` sampled on entry, `during` the window of the block."""

    def __init__(self, before_seconds: float = BEFORE_SECONDS) -> None:
        self.before_seconds = before_seconds
        self.before: Load | None = None
        self.during: Load | None = None

    @property
    def busy(self) -> bool:
        """Others used the cores before or during the block, or the load could not be read while it ran (then
        nothing says the figure is clean: it counts as taken under load)."""
        return self.during is None or any(load is not None and load.busy for load in (self.before, self.during))

    def describe(self) -> str:
        """What the watch read before and during the block, in Load.describe's words."""
        parts = [f"{when}, {load.describe()}" for when, load in (("before", self.before), ("during", self.during))
                 if load is not None]
        return "; ".join(parts + ([] if self.during is not None else ["the load could not be read during it"]))

    def to_dict(self) -> dict[str, Any]:
        return {"before": self.before.to_dict() if self.before else None,
                "during": self.during.to_dict() if self.during else None, "busy": self.busy,
                "measured": self.during is not None}


@contextmanager
def watched(before_seconds: float = BEFORE_SECONDS) -> Iterator[Watch]:
    """Watches the block: `with watched() as w: ...timed code...`, then `w.busy`, `w.to_dict()`."""
    watch = Watch(before_seconds)
    if before_seconds > 0:
        watch.before = sample(before_seconds)
    start = snapshot()
    try:
        yield watch
    finally:
        end = snapshot()
        if start is not None and end is not None:
            watch.during = between(start, end)


def busiest_others(seconds: float = 1.0, top: int = 3) -> tuple[Load | None, list[str]]:
    """The load over `seconds`, and the processes (other than this one) that used the most CPU meanwhile, each as
    "pid name: share of a core": what a refusal names, so the user knows what to stop."""
    def per_process() -> dict[int, tuple[str, float]]:
        found = {}
        for entry in _PROC.glob("[0-9]*"):
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            found[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)  # utime + stime
        return found

    first, start = per_process(), snapshot()
    time.sleep(seconds)
    second, end = per_process(), snapshot()
    load = None if start is None or end is None else between(start, end)
    me = os.getpid()
    used = sorted(((cpu - first[pid][1], pid, name) for pid, (name, cpu) in second.items()
                   if pid in first and pid != me), reverse=True)
    return load, [f"{pid} {name}: {cpu / seconds:.0%} of a core" for cpu, pid, name in used[:top] if cpu > 0]
