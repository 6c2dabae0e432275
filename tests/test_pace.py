"""The rate and the time left follow the tokens as the engine produces them (cbgen.progress.pace), tested on a fake
clock and a simulated engine whose short answers finish first."""

from __future__ import annotations

import io
import random
import re

from rich.console import Console

from cbgen.cli.display import PlainProgress, RichProgress
from cbgen.progress.pace import Pace


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_counts_unfinished_sequences():
    clock = Clock()
    pace = Pace(total=10, cap=100, clock=clock)
    clock.now = 2.0
    pace.observe([10, 10, 10, 10])  # nothing finished, 40 tokens in 2 s
    assert pace.rate() == 20.0
    # nothing finished yet: every sequence is assumed to run to its cap
    assert pace.tokens_to_come() == 6 * 100 + 4 * 90
    assert pace.eta() == (6 * 100 + 4 * 90) / 20.0


def test_the_rate_is_over_a_recent_window():
    clock = Clock()
    pace = Pace(total=None, cap=100, clock=clock)
    for second in range(1, 61):  # 10 tok/s for a minute, then 40 tok/s
        clock.now = float(second)
        pace.observe([10 * second if second <= 30 else 300 + 40 * (second - 30)])
    assert abs(pace.rate() - 40.0) < 1.0
    assert pace.eta() is None  # the total is unknown


def simulate(lengths: list[int], slots: int, until: float | None, pace: Pace | None = None) -> float:
    """An engine of `slots` concurrent sequences, one token each per second, shortest answers in no particular
    order; returns the time it ends, or feeds `pace` up to `until` and returns that time."""
    waiting = list(lengths)
    running: list[list[int]] = []  # [generated, length]
    t = 0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append([0, waiting.pop(0)])
        t += 1
        for sequence in running:
            sequence[0] += 1
        done = [s for s in running if s[0] >= s[1]]
        running = [s for s in running if s[0] < s[1]]
        if pace is not None:
            pace.clock.now = float(t)  # type: ignore[attr-defined]
            if done:
                pace.finished([s[0] for s in done])
            pace.observe([s[0] for s in running])
            if t >= (until or 0):
                return float(t)
    return float(t)


def test_the_time_left_is_not_fooled_by_short_answers_finishing_first():
    """656 sequences of 8-256 tokens, 64 at a time (the HumanEval -n 4 case's shape): early on, the finished ones are
    the short ones. At 10 % and 15 % of the way the estimate is within 25 % of the true time left, and closer than
    the old one (elapsed time per finished sequence), while the rate is the engine's 64 tokens a second."""
    rng = random.Random(0)
    lengths = [min(256, int(rng.expovariate(1 / 120)) + 8) for _ in range(656)]
    end = simulate(lengths, 64, None)
    for share in (0.10, 0.15):
        checked = int(share * end)
        pace = Pace(total=len(lengths), cap=256, clock=Clock())
        simulate(lengths, 64, checked, pace)
        true_left = end - checked
        eta = pace.eta()
        old = checked / pace.done * (len(lengths) - pace.done)
        assert eta is not None and abs(eta - true_left) / true_left < 0.25, (share, eta, true_left)
        assert abs(eta - true_left) < abs(old - true_left), (share, eta, old, true_left)
        assert abs(pace.rate() - 64) < 1


def test_the_display_reads_the_engine_before_anything_finishes():
    out = io.StringIO()
    plain = PlainProgress(Console(file=out, width=200, force_terminal=False))
    plain.watch(lambda: [30, 30], cap=64)
    plain.start(4, "sequence")
    plain.counters.pace.started -= 1.0  # type: ignore[union-attr]  # a second ago
    plain.counters.pace.samples[0] = (plain.counters.pace.started, 0)  # type: ignore[union-attr]
    plain.finish()
    line = out.getvalue().splitlines()[-1]
    found = re.search(r"0/4 sequences, ([0-9.]+) generated tok/s, .*, ETA ", line)
    assert found and float(found.group(1)) > 0, line  # 60 tokens a second ago, nothing finished

    rich = RichProgress(Console(file=io.StringIO(), width=200, force_terminal=True))
    rich.watch(lambda: [5], cap=64)
    rich.start(2, "request")  # not sequences (rows with their own n): the pace does not apply
    rich.advance(1, 10, 5, 0)
    assert rich.counters.pace is None
    rich.finish()


def test_a_job_shows_the_engine_s_unfinished_tokens(tiny_model_dir, tmp_path):
    """A real job hands its sink the engine's count: while the first answers are written, the others are still in
    the engine with tokens of their own, which the display counts."""
    import threading

    from cbgen.config import build_config
    from cbgen.job.run import run_job
    from cbgen.progress import NullProgress
    from tests.helpers import write_jsonl

    rows = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": f"Count to {i}.", "max_new_tokens": 4 + 8 * i}
                                              for i in range(8)])

    class Recorder(NullProgress):
        def __init__(self):
            self.seen: list[list[int]] = []
            self.cap = 0

        def watch(self, live, cap):
            self.live, self.cap = live, cap

        def advance(self, done, prompt_tokens, generated_tokens, failed, lengths=()):
            self.seen.append(self.live())

    overrides = {("input", "path"): (str(rows), "INPUT"), ("output", "dir"): (str(tmp_path / "out"), "-o"),
                 ("model", "model"): (str(tiny_model_dir), "--model"), ("model", "dtype"): ("float32", "--dtype"),
                 ("generation", "max_new_tokens"): (64, "--max-new-tokens"),
                 ("generation", "stop_token_ids"): ([], "--stop-token-id")}
    recorder = Recorder()
    summary = run_job(build_config(None, overrides), recorder, threading.Event())
    assert summary.status == "complete" and recorder.cap == 64
    assert len(recorder.seen) == 8
    first = recorder.seen[0]  # the shortest answer just finished: the longer ones are under way
    assert first and all(0 < tokens < 64 for tokens in first)


def test_the_count_never_falls_when_a_final_length_is_below_its_last_observed_count():
    """A finishing sequence's final length can be below what was last observed of it (its stop string trimmed, or
    read a step late), and the engine can drop a finished sequence before its result arrives: the tokens counted
    never fall, so the rate is never negative, even in a job's last stretch, where few tokens come."""
    clock = Clock()
    pace = Pace(total=80, cap=256, clock=clock)
    counted, rates = [], []

    def look() -> None:
        counted.append(pace.produced)
        rates.append(pace.rate())

    running = [[0, 40 + 30 * i] for i in range(4)]  # [generated, length]: the last four sequences, one token a second
    while running:
        clock.now += 1.0
        for sequence in running:
            sequence[0] += 1
        done = [s for s in running if s[0] >= s[1]]
        running = [s for s in running if s[0] < s[1]]
        if done:
            pace.observe([s[0] for s in running])  # the engine has let them go; their results are not in yet
            look()
            pace.finished([s[0] - 25 for s in done])  # 25 tokens fewer than last observed
        pace.observe([s[0] for s in running])
        look()
    assert all(later >= earlier for earlier, later in zip(counted, counted[1:])), counted
    assert min(rates) >= 0.0, min(rates)
    assert pace.produced >= sum(40 + 30 * i for i in range(4)) - 4 * 25  # what the finished lengths say, at least
