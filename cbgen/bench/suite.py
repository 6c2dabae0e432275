"""`cbgen bench --suite`: every headline comparison, side by side in one run on this machine, as one table (each row
naming the machine, its figure, its goal and whether the machine was quiet while it was measured), bench.json and
bench.png.

Each comparison times its paths alternately, round after round (so a slow minute of the machine falls on all of
them), and its figure is a ratio of the paths' medians. Every timed path is watched (cbgen.bench.load): a run timed
while other processes used the cores is left out of its figure where every path has quiet runs (the row names it),
and the figure is marked void where one has none; a machine busy before the suite starts is refused unless asked to
measure anyway. The sections are cbgen.bench.sections'; `--quick` runs them all, smaller and once.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from cbgen.bench import load
from cbgen.bench.machine import Machine
from cbgen.bench.workloads import BenchWorkload
from cbgen.errors import CbgenError, ExitCode

BF16_KINDS = frozenset({"amx-bf16", "avx512-bf16"})  # CPUs with bfloat16 units
# --quick's cuts, (requests, new tokens): the fixed workload's 128-token prompts in the generation and invariance
# sections, and the sampling workload; the fixed workload at 1B in the scale section (requests, prompt tokens, new
# tokens)
QUICK_FIXED, QUICK_SAMPLING = (16, 32), (16, 64)
QUICK_SCALE = (4, 64, 16)
NOT_MEASURED = "not measured"
STANDINGS = ("met", "missed", "void", NOT_MEASURED)  # a goal's, on a machine where it applies
UNHELD_PATHS = ("llama.cpp",)  # timed paths that --hold does not hold (their own builds' instructions)


class MachineBusy(CbgenError):
    """Other processes use the cores: figures measured now would mean nothing."""

    exit_code = ExitCode.STOPPED  # a temporary failure: run it again when the machine is quiet


@dataclass(frozen=True)
class Goal:
    """A figure's goal: `op` (">=" or "<=") `value`, on the CPU kinds `kinds` (None: every kind)."""

    op: str
    value: float
    kinds: frozenset[str] | None = None

    def applies(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    def met(self, figure: float) -> bool:
        return figure >= self.value if self.op == ">=" else figure <= self.value

    def text(self) -> str:
        where = "" if self.kinds is None else f" ({', '.join(sorted(self.kinds))})"
        return f"{'≥' if self.op == '>=' else '≤'} {self.value:g}{where}"


@dataclass(frozen=True)
class Plan:
    """How much the suite measures: rounds per comparison and the sizes of its inputs."""

    mode: str  # full | quick
    size: str  # the generation workloads' size (cbgen.bench.workloads.SIZES)
    rounds: int  # rounds of the fast comparisons
    generation_rounds: int  # rounds against llama.cpp and generate_batch (the slow paths)
    invariance_workloads: tuple[str, ...]
    invariance_float32: bool  # invariance in float32 too, where the machine's dtype is another
    embed_texts: tuple[int, ...]  # texts per encode-alone comparison
    command_texts: tuple[int, ...]  # texts per whole-command comparison (--quick: none, but at size tiny)
    dedup_rows: int
    # (requests, new tokens) the fixed and sampling workloads are cut to (None: as built for `size`); the scale
    # section's fixed workload at 1B (requests, prompt tokens, new tokens); `scale_stock`: the scale section also
    # times stock linear layers
    fixed: tuple[int, int] | None = None
    sampling: tuple[int, int] | None = None
    scale_fixed: tuple[int, int, int] = (16, 128, 64)
    scale_stock: bool = True
    scale_rounds: int = 2  # its paths take minutes each at 1B on 2 cores: two alternating rounds, --quick one

    @classmethod
    def of(cls, quick: bool, size: str) -> Plan:
        tiny = size == "tiny"
        if quick:  # under 5 minutes on a 2-core AVX2 CPU: each section's paths once, on smaller cuts of its workloads
            return cls("quick", size, 1, 1, ("fixed",), False, (32,) if tiny else (300,), (32,) if tiny else (),
                       2_000 if tiny else 20_000, fixed=None if tiny else QUICK_FIXED,
                       sampling=None if tiny else QUICK_SAMPLING, scale_fixed=QUICK_SCALE, scale_stock=False,
                       scale_rounds=1)
        return cls("full", size, 3, 2, ("fixed", "mixed", "shared-prefix"), True, (32,) if tiny else (300, 10_000),
                   (32,) if tiny else (300, 10_000), 2_000 if tiny else 100_000)

    def cut(self, workload: BenchWorkload) -> BenchWorkload:
        """`workload` as this plan runs it: the fixed and sampling workloads cut to the plan's requests and new
        tokens (the first prompts, each as long as built)."""
        to = {"fixed": self.fixed, "sampling": self.sampling}.get(workload.name)
        return workload if to is None else workload.cut(*to)


@dataclass
class Sample:
    value: float  # seconds, or seconds per generated token
    watch: dict[str, Any]
    busy: bool
    load: str = ""  # what the watch read, in words (a void figure's note names its loud runs with it)


class Timings:
    """The samples of one comparison's paths, each timed inside a load watch."""

    def __init__(self, show: Callable[[str], None] = lambda line: None,
                 watch: Callable[[], AbstractContextManager[load.Watch]] = load.watched) -> None:
        self.samples: dict[str, list[Sample]] = defaultdict(list)
        self.show = show
        self.watch = watch  # what reads the machine's load around each timed call

    def record(self, path: str, call: Callable[[], Any], per_token: bool = False) -> Any:
        """Runs `call` once as `path`. Its result's own seconds count where it has them (a bench Measurement,
        model set-up excluded) or are a number of seconds (a whole command); else the wall time of the call.
        `per_token`: the value is seconds per generated token."""
        with self.watch() as watch:
            started = time.perf_counter()
            result = call()
            wall = time.perf_counter() - started
        seconds = getattr(result, "seconds", result if isinstance(result, float) else wall)
        value = seconds / max(result.generated_tokens, 1) if per_token else seconds
        self.samples[path].append(Sample(value, watch.to_dict(), watch.busy, watch.describe()))
        self.show(f"{path:<44} {seconds:8.2f} s{'  (busy: void)' if watch.busy else ''}")
        return result

    def median(self, path: str) -> float:
        return statistics.median(s.value for s in self.samples[path])

    def figures(self, paths: tuple[str, ...]) -> tuple[dict[str, float], bool, str]:
        """Each path's median for one figure, whether the figure is void, and which runs were left out of it. Where
        some runs were timed under load and every path has quiet ones, the medians of the quiet runs (the others
        named): one disturbed round of three does not void a figure the other two measured. Else the medians of all
        runs, void where any was under load."""
        quiet = {p: [s.value for s in self.samples[p] if not s.busy] for p in paths}
        loud = {p: [i + 1 for i, s in enumerate(self.samples[p]) if s.busy] for p in paths}
        if any(loud.values()) and not all(quiet.values()):  # void: each loud run named with what its watch read
            named = "; ".join(f"{p} run {i + 1} ({s.load})" for p in paths
                              for i, s in enumerate(self.samples[p]) if s.busy)
            return {p: self.median(p) for p in paths}, True, f"timed under load: {named}"
        left = "; ".join(f"{p} run {', '.join(map(str, runs))}" for p, runs in loud.items() if runs)
        return ({p: statistics.median(values) for p, values in quiet.items()}, False,
                f"left out, timed under load: {left}" if left else "")


@dataclass
class Row:
    section: str
    name: str
    figure: float | None  # None: not measured (`note` says why)
    unit: str  # "x" (a ratio) or "s"
    meaning: str  # how to read the figure
    goal: Goal | None = None
    applies: bool = False  # the goal applies to this run (this machine's kind, the workloads' size)
    why_not: str = ""  # why a goal does not apply to this run
    paths: dict[str, list[float]] = field(default_factory=dict)
    busy: bool = False
    note: str = ""
    machine: str = ""
    dtype: str | None = None  # the model's, where a model ran ("" where none did; None: the generator's)
    exact: float | None = None  # the figure before rounding: what its goal is checked against

    @property
    def against_unheld(self) -> bool:
        """Whether a path of the figure is one a hold (--hold) does not reach: llama.cpp runs its own build's
        instructions, the machine's own, whatever kind cbgen is held to."""
        return any(path.startswith(UNHELD_PATHS) for path in self.paths)

    @property
    def met(self) -> bool | None:
        if self.goal is None or not self.applies or self.figure is None:
            return None
        return self.goal.met(self.exact if self.exact is not None else self.figure)

    @property
    def standing(self) -> str | None:
        """Where a row whose goal applies here stands: met, missed, void (measured under load, or where the load
        could not be read) or not measured (`note` says why); None for a row without a goal that applies."""
        if self.goal is None or not self.applies:
            return None
        if self.figure is None:
            return NOT_MEASURED
        if self.busy:
            return "void"
        return "met" if self.met else "missed"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self) | {"met": self.met, "standing": self.standing}
        data["goal"] = None if self.goal is None else {"op": self.goal.op, "value": self.goal.value,
                                                       "kinds": sorted(self.goal.kinds) if self.goal.kinds else None,
                                                       "text": self.goal.text()}
        return data


def ratio(section: str, name: str, timings: Timings, top: str, bottom: str, meaning: str,
          goal: Goal | None = None, note: str = "") -> Row:
    """median(top) / median(bottom), from the samples of both paths (Timings.figures: the quiet ones)."""
    return _row(section, name, lambda m: m[top] / m[bottom], "x", meaning, timings, (top, bottom), goal, note)


def seconds(section: str, name: str, timings: Timings, path: str, meaning: str, goal: Goal | None = None,
            note: str = "") -> Row:
    return _row(section, name, lambda m: m[path], "s", meaning, timings, (path,), goal, note)


def _row(section: str, name: str, figure: Callable[[dict[str, float]], float], unit: str, meaning: str,
         timings: Timings, paths: tuple[str, ...], goal: Goal | None, note: str) -> Row:
    medians, void, left = timings.figures(paths)
    exact = figure(medians)
    return Row(section, name, round(exact, 3), unit, meaning, goal,
               paths={p: [round(s.value, 6) for s in timings.samples[p]] for p in paths},
               busy=void, note="; ".join(part for part in (note, left) if part), exact=exact)


def skipped(section: str, name: str, why: str, goal: Goal | None = None) -> Row:
    return Row(section, name, None, "x", "", goal, note=f"not measured: {why}")


@dataclass
class Context:
    """What the sections share: the plan, this machine, the model settings, a scratch folder, the log."""

    plan: Plan
    machine: Machine
    model: str | None  # --model for the generator (None: the embedded SmolLM2)
    embed_model: str | None
    folder: Any  # a pathlib.Path, removed after the run
    log: Callable[[str], None]
    loaded: dict[str, Any] = field(default_factory=dict)  # dtype -> LoadedModel, loaded once each

    def generator(self, dtype: str = "auto") -> Any:
        """The generation model in `dtype`, loaded once for the whole suite."""
        if dtype not in self.loaded:
            from cbgen.config import ModelSection
            from cbgen.model.load import load_model

            self.log(f"loading the generation model ({dtype})")
            self.loaded[dtype] = load_model(ModelSection(model=self.model, dtype=dtype))  # type: ignore[arg-type]
        return self.loaded[dtype]


def check_quiet(allow_busy: bool, log: Callable[[str], None]) -> dict[str, Any] | None:
    """The machine's load over a second before anything runs: refused when busy, unless `allow_busy` (then every
    figure is watched and marked as it goes)."""
    reading, busiest = load.busiest_others(1.0)
    if reading is None:
        log("the machine's load cannot be read here (no /proc/stat): every figure is marked void")
        return None
    if reading.busy:
        who = f" ({'; '.join(busiest)})" if busiest else ""
        if not allow_busy:
            raise MachineBusy(f"the machine is busy: {reading.describe().removeprefix('busy: ')}{who}. Figures "
                              "measured now would mean nothing: run it again when the machine is quiet, or pass "
                              "--allow-busy to measure anyway (the figures are then marked void)")
        log(f"measuring on a busy machine, as asked: {reading.describe()}{who}")
    return reading.to_dict() | {"busiest": busiest}


@contextmanager
def section(name: str, rows: list[Row], log: Callable[[str], None],
            goals: tuple[tuple[str, Goal], ...] = (), took: dict[str, int] | None = None) -> Iterator[None]:
    """A section's rows are kept if it fails: the failure becomes a row of its own, each goal it would have
    measured (`goals`: comparison and goal) a row not measured, and the suite goes on. Its seconds (model loads and
    warm-ups included) go to the log and to `took`."""
    started = time.perf_counter()
    log(f"— {name}")
    try:
        yield
    except (CbgenError, RuntimeError, OSError, ValueError, ImportError) as e:
        from cbgen.errors import first_line

        rows.append(Row(name, f"{name} (failed)", None, "x", "", note=f"failed: {first_line(e)}"))
        rows += [skipped(name, comparison, f"the {name} section failed ({first_line(e)})", goal)
                 for comparison, goal in goals]
        log(f"{name} failed: {first_line(e)}")
    seconds = round(time.perf_counter() - started)
    log(f"{name}: {seconds} s")
    if took is not None:
        took[name] = seconds


def summary(rows: list[Row]) -> dict[str, int]:
    """The rows whose goal applies here, by standing: met, missed, void and not measured."""
    standings = [r.standing for r in rows]
    return {standing.replace(" ", "_"): standings.count(standing) for standing in STANDINGS}
