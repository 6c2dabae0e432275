"""How fast a job goes and how long it has left, from the tokens the engine produces as it produces them.

A rate of finished sequences' tokens starts near zero (nothing has finished) and climbs, and an ETA from finished
sequences over elapsed time swings as they finish in bursts: measured on HumanEval with `-n 4 --temperature 0.8`
(656 sequences, 11 minutes), the bar said "14.9 tok/s, ETA 0:16:19" at 53 s and "106.7 tok/s, ETA 0:02:43" at 1:40.
Here the rate counts the tokens of unfinished sequences too, over the last `WINDOW` seconds, and the time left is the
tokens still to come at that rate. The tokens still to come are estimated from what is known of the lengths: each
sequence's cap (max_new_tokens), the lengths of the finished ones and how far the unfinished ones have got. Short
answers finish first, so the finished lengths alone underestimate: the length distribution is the Kaplan-Meier
estimate over finished lengths (events) and unfinished ones (censored), with whatever survives the longest length
seen assumed to run to the cap. Until a sequence has finished, every one is assumed to run to its cap. The time
left is at least what the unfinished sequence furthest from its end needs at one token per step. It still runs
short in a job's last stretch, once the queue is empty and the last sequences run with few others (in the test's
simulation: 40 % short at 80 % of the way); a schedule simulation over the length distribution would fix that.

The tokens counted never fall: finished lengths plus the unfinished sequences' counts can drop below an earlier sum
(a finishing sequence's final length can be below what was last observed of it, and the engine lets a sequence go
before its result arrives), and such a drop once made the display say "-40.7 generated tok/s". So the count is the
highest sum seen, taken when the engine is read (`observe`): a finished sequence is then no longer among the live
ones, and is counted once.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

WINDOW = 20.0  # seconds of produced tokens the rate is measured over


class Pace:
    """Tokens produced and time left for a job of `total` sequences (None: unknown) of at most `cap` new tokens."""

    def __init__(self, total: int | None, cap: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.cap = max(cap, 1)
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.finished_tokens = 0
        self.lengths: Counter[int] = Counter()  # finished sequences by length
        self.live: list[int] = []  # tokens so far of each unfinished sequence, as last observed
        self.samples: deque[tuple[float, int]] = deque([(self.started, 0)])
        self._produced = 0  # the highest count seen: tokens produced never fall
        self.longest_remaining = 0.0  # expected tokens left of the unfinished sequence furthest from its end
        self._to_come: float | None = None  # the estimate for the latest observation

    @property
    def produced(self) -> int:
        """Generated tokens so far: never fewer than before."""
        return self._produced

    def finished(self, lengths: Sequence[int]) -> None:
        """Sequences that finished with these numbers of generated tokens. Counted at the next `observe`: until
        then the last observation still holds them among the live ones."""
        self.done += len(lengths)
        self.finished_tokens += sum(lengths)
        self.lengths.update(min(length, self.cap) for length in lengths if length > 0)  # a failed one: no length
        self._to_come = None

    def observe(self, live: Sequence[int]) -> None:
        """The generated tokens so far of every unfinished sequence in the engine."""
        self.live = list(live)
        self._produced = max(self._produced, self.finished_tokens + sum(self.live))
        self._sample()

    def _sample(self) -> None:
        self._to_come = None
        now = self.clock()
        self.samples.append((now, self.produced))
        while len(self.samples) > 2 and self.samples[1][0] < now - WINDOW:
            self.samples.popleft()

    def rate(self) -> float:
        """Generated tokens per second over the last WINDOW seconds (since the start, before that)."""
        (first, tokens_then), now = self.samples[0], self.clock()
        return (self.produced - tokens_then) / (now - first) if now > first else 0.0

    def _survival(self) -> np.ndarray:
        """S(t), t = 0..cap: the estimated share of sequences still generating after t tokens (an unfinished one
        with g tokens is at risk up to g)."""
        import numpy as np  # here: `cbgen --help` must not pay for numpy's import

        events = np.zeros(self.cap + 1)
        for length, count in self.lengths.items():
            events[length] = count
        live = np.minimum(np.asarray(self.live, dtype=np.int64), self.cap)
        censored = np.bincount(live, minlength=self.cap + 1)[: self.cap + 1]
        gone = np.concatenate(([0.0], np.cumsum(events + censored)[:-1]))
        at_risk = events.sum() + len(live) - gone
        survival = np.cumprod(np.where(at_risk > 0, 1 - events / np.maximum(at_risk, 1), 1.0))
        survival[self.cap] = 0.0  # nothing runs past its cap
        return survival

    def tokens_to_come(self) -> float | None:
        """Generated tokens the job still needs, by the estimate above; None when the total is unknown. Worked out
        once per new observation (a display asks several times a second)."""
        if self.total is None:
            return None
        if self._to_come is None:
            self._to_come = self._estimate(self.total)
        return self._to_come

    def _estimate(self, total: int) -> float:
        import numpy as np

        waiting = max(total - self.done - len(self.live), 0)
        live = np.minimum(np.asarray(self.live, dtype=np.int64), self.cap)
        if not self.lengths:  # nothing finished yet: every sequence to its cap
            remaining = (self.cap - live).astype(float)
            self.longest_remaining = float(remaining.max(initial=0.0))
            return waiting * self.cap + float(remaining.sum())
        survival = self._survival()
        # tail[t] = sum of S(u) for u = t..cap-1: the expected tokens from t on, times S(t)
        tail = np.concatenate((np.cumsum(survival[: self.cap][::-1])[::-1], [0.0]))
        alive = survival[live]
        remaining = np.divide(tail[live], alive, out=np.zeros(len(live)), where=alive > 0)
        self.longest_remaining = float(remaining.max(initial=0.0))
        return waiting * float(tail[0]) + float(remaining.sum())

    def eta(self) -> float | None:
        """Seconds left, or None when it cannot be estimated yet (no tokens, or the total unknown)."""
        to_come, rate = self.tokens_to_come(), self.rate()
        if to_come is None or rate <= 0:
            return None
        # at least the time the longest-running sequence needs, one token per step (the job's last sequences run
        # with few others, where the rate in tokens drops)
        seconds_per_step = len(self.live) / rate if self.live else 0.0
        return max(to_come / rate, self.longest_remaining * seconds_per_step)
