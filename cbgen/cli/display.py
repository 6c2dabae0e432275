"""What `cbgen run` shows: progress as a Rich display on a terminal or a plain line every few seconds elsewhere
(cron, Slurm logs), and the summary table at the end."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from cbgen.kinds import kind_of
from cbgen.outputs.summary import RunSummary
from cbgen.progress import LiveLengths, NullProgress, plural
from cbgen.progress.pace import Pace

if TYPE_CHECKING:
    from cbgen.job.dry_run import DryRunReport


class _Counters:
    """What the display shows: counts from finished results, and the pace (cbgen.progress.pace) of the tokens the engine
    produces, read from `live` at most every REFRESH seconds, when the job gave one and sequences are the unit."""

    REFRESH = 0.25

    def __init__(self) -> None:
        self.done = 0
        self.failed = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.started = time.perf_counter()
        self.live: LiveLengths | None = None
        self.cap = 1
        self.pace: Pace | None = None
        self.read = 0.0
        self.computed = False  # a job that generates nothing: every token its forward passes read counts

    def start(self, total: int | None, unit: str, verb: str = "generating") -> None:
        self.started = time.perf_counter()
        self.computed = verb != "generating"
        if self.live is not None and unit == "sequence":
            self.pace = Pace(total, self.cap)

    def add(self, sequences: int, prompt_tokens: int, generated_tokens: int, failed: int,
            lengths: Sequence[int]) -> None:
        self.done += sequences
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        self.failed += failed
        if self.pace is not None:
            self.pace.finished(lengths)

    def _observe(self) -> None:
        now = time.perf_counter()
        if self.pace is not None and self.live is not None and now - self.read >= self.REFRESH:
            self.read = now
            self.pace.observe(self.live())

    @property
    def tokens_per_second(self) -> float:
        self._observe()
        if self.pace is not None:
            return self.pace.rate()
        elapsed = time.perf_counter() - self.started
        tokens = self.generated_tokens + (self.prompt_tokens if self.computed else 0)
        return tokens / elapsed if elapsed > 0 else 0.0

    @property
    def rate_label(self) -> str:
        """What tokens_per_second counts."""
        return "computed tok/s (every token read)" if self.computed else "generated tok/s"

    def seconds_left(self, total: int | None) -> float | None:
        self._observe()
        if self.pace is not None:
            return self.pace.eta()
        if not total or not self.done:
            return None
        return (time.perf_counter() - self.started) / self.done * (total - self.done)


class _TokensPerSecond(ProgressColumn):
    def __init__(self, counters: _Counters) -> None:
        super().__init__()
        self.counters = counters

    def render(self, task) -> Text:
        failed = f", {self.counters.failed} failed" if self.counters.failed else ""
        rate = "computed tok/s" if self.counters.computed else "tok/s"
        return Text(f"{self.counters.tokens_per_second:,.1f} {rate}{failed}", style="cyan")


class _TimeLeft(ProgressColumn):
    """The time left: from the tokens still to come where the pace is known, else from finished requests."""

    def __init__(self, counters: _Counters) -> None:
        super().__init__()
        self.counters = counters

    def render(self, task) -> Text:
        left = self.counters.seconds_left(int(task.total) if task.total is not None else None)
        if left is None:
            return Text("-:--:--", style="progress.remaining")
        minutes, seconds = divmod(int(left), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"{hours}:{minutes:02d}:{seconds:02d}", style="progress.remaining")  # as the elapsed column


class RichProgress:
    """Requests done / total, generated tokens per second, elapsed time and ETA, on stderr."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.counters = _Counters()
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _TokensPerSecond(self.counters),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            _TimeLeft(self.counters),
            console=console,
            transient=False,
        )
        self.task: TaskID | None = None

    def stage(self, message: str) -> None:
        self.console.log(message)

    def watch(self, live: LiveLengths, cap: int) -> None:
        self.counters.live, self.counters.cap = live, cap

    def start(self, total: int | None, unit: str = "sequence", verb: str = "generating") -> None:
        self.counters.start(total, unit, verb)
        self.progress.start()
        self.task = self.progress.add_task(f"{verb} ({unit}s)", total=total)

    def advance(self, sequences: int, prompt_tokens: int, generated_tokens: int, failed: int,
                lengths: Sequence[int] = ()) -> None:
        self.counters.add(sequences, prompt_tokens, generated_tokens, failed, lengths)
        if self.task is not None:
            self.progress.advance(self.task, sequences)

    def finish(self) -> None:
        if self.task is not None:
            self.progress.stop()


class PlainProgress:
    """One line every `interval` seconds, for logs that are not terminals."""

    def __init__(self, console: Console, interval: float = 5.0) -> None:
        self.console = console
        self.interval = interval
        self.counters = _Counters()
        self.total: int | None = None
        self.unit = "sequence"
        self.verb = "generating"
        self.last = 0.0

    def stage(self, message: str) -> None:
        self._line(message)

    def watch(self, live: LiveLengths, cap: int) -> None:
        self.counters.live, self.counters.cap = live, cap

    def start(self, total: int | None, unit: str = "sequence", verb: str = "generating") -> None:
        self.total = total
        self.unit = unit
        self.verb = verb
        self.counters.start(total, unit, verb)
        self.last = time.perf_counter()
        self._line(f"{verb} {plural(total, unit) if total is not None else f'all {unit}s'}")

    def advance(self, sequences: int, prompt_tokens: int, generated_tokens: int, failed: int,
                lengths: Sequence[int] = ()) -> None:
        self.counters.add(sequences, prompt_tokens, generated_tokens, failed, lengths)
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self._report()

    def finish(self) -> None:
        self._report()

    def _report(self) -> None:
        c = self.counters
        done = f"{c.done}/{self.total}" if self.total else str(c.done)
        left = c.seconds_left(self.total)
        eta = f", ETA {_duration(left)}" if left is not None and c.done < (self.total or 0) else ""
        elapsed = time.perf_counter() - c.started
        noun = self.unit if (self.total or c.done) == 1 else f"{self.unit}s"
        self._line(f"{done} {noun}, "
                   f"{c.tokens_per_second:.1f} {c.rate_label}, "
                   f"{c.failed} failed, "
                   f"elapsed {_duration(elapsed)}{eta}")

    def _line(self, message: str) -> None:
        line = f"[cbgen {time.strftime('%H:%M:%S')}] {message}"
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def make_progress(console: Console, quiet: bool):
    if quiet:
        return NullProgress()
    return RichProgress(console) if console.is_terminal else PlainProgress(console)


def summary_table(summary: RunSummary) -> Table:
    """The end-of-run summary, as the job's kind words it (cbgen.kinds)."""
    kind = kind_of(summary.kind)
    return _pairs(kind.summary_title, kind.summary_rows(summary, _duration, cache_line))


def cache_line(cache: dict) -> str:
    """The result cache's part of a run, in words: what it answered, what was computed, or why it was off."""
    if not cache:
        return "-"
    if not cache.get("on"):
        return f"off ({cache.get('why')})"
    near = f" + {cache['near_hits']:,} near" if cache.get("near_hits") else ""
    line = f"{cache.get('hits', 0):,}{near} answered, {cache.get('misses', 0):,} computed"
    if cache.get("not_cached"):
        line += f", {cache['not_cached']:,} not cacheable (unseeded sampling)"
    if cache.get("near_hits_skipped"):
        line += f"; {cache['near_hits_skipped']:,} held but computed afresh (other numerics: --cache-near-hits)"
    return line


def _pairs(title: str, rows: list[tuple[str, str]]) -> Table:
    """A two-column table of names (bold) and values."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    return table


def dry_run_table(report: DryRunReport) -> Table:
    """What `cbgen run --dry-run` found, as a table."""
    table = Table(title="cbgen dry run (nothing generated)", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    kv = report.kv_cache
    rows = [
        ("rows", f"{report.rows:,}"),
        ("error records it would write", f"{report.errors:,}"),
        *[("", reason) for reason in report.first_errors],
        ("prompt tokens", f"{report.prompt_tokens:,} (longest {report.longest_prompt:,})"),
        ("sequences", f"{report.max_sequences:,}, at most {report.max_generated_tokens:,} generated tokens"),
        ("KV cache", f"{kv.get('num_blocks', '?')} blocks of {kv.get('page_size')} tokens"
                     + (f", {kv['bytes'] / 2**30:.2f} GiB" if kv.get("bytes") else "") + f" ({kv.get('chosen_by')})"),
    ]
    if report.cached is not None:
        held = f"{report.cached:,} of {report.rows - report.errors:,} requests answered from it"
        if report.cached_other_numerics:
            held += f"; {report.cached_other_numerics:,} more held with other numerics (--cache-near-hits takes them)"
        rows.append(("result cache", held))
    if report.estimate is not None:
        e = report.estimate
        rows += [("estimated generation", f"{_duration(e['estimated_generation_s'])}"), ("how", e["how"])]
    for name, value in rows:
        table.add_row(name, value)
    return table
