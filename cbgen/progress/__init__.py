"""What a job reports as it goes. The library only calls these methods; the CLI turns them into a Rich display or
plain log lines (cbgen.cli.display)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

# The tokens generated so far by each unfinished sequence in the engine (cbgen.engine.Engine.live)
LiveLengths = Callable[[], list[int]]


class ProgressSink(Protocol):
    def stage(self, message: str) -> None: ...
    def start(self, total: int | None, unit: str = "sequence", verb: str = "generating") -> None: ...
    def watch(self, live: LiveLengths, cap: int) -> None:
        """Before `start`: where to read unfinished sequences' tokens, and the most new tokens a sequence may have:
        the rate and time left then follow the tokens as the engine produces them (cbgen.progress.pace)."""
    def advance(self, done: int, prompt_tokens: int, generated_tokens: int, failed: int,
                lengths: Sequence[int] = ()) -> None:
        """`lengths`: the generated tokens of each finished sequence, when sequences are the unit."""
    def finish(self) -> None: ...


class NullProgress:
    """Reports nothing (--quiet, and library use without a sink)."""

    def stage(self, message: str) -> None: ...
    def start(self, total: int | None, unit: str = "sequence", verb: str = "generating") -> None: ...
    def watch(self, live: LiveLengths, cap: int) -> None: ...
    def advance(self, done: int, prompt_tokens: int, generated_tokens: int, failed: int,
                lengths: Sequence[int] = ()) -> None: ...
    def finish(self) -> None: ...


def plural(count: int, noun: str) -> str:
    """'1 shard', '2 shards', '0 shards'."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class BarProgress:
    """A progress bar for library callers (cbgen.api): tqdm's, which is a widget in a notebook and a line of text
    on a terminal. Stages are not shown: a notebook wants the bar, not a log."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.generated = 0

    def stage(self, message: str) -> None: ...

    def start(self, total: int | None, unit: str = "sequence", verb: str = "generating") -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, unit=unit, desc=verb, disable=False)

    def watch(self, live: LiveLengths, cap: int) -> None: ...

    def advance(self, done: int, prompt_tokens: int, generated_tokens: int, failed: int,
                lengths: Sequence[int] = ()) -> None:
        self.generated += generated_tokens
        if self.bar is not None:
            self.bar.update(done)
            self.bar.set_postfix(tokens=self.generated, failed=failed or None, refresh=False)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.close()
