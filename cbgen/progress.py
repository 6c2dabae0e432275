"""What a job reports as it goes. The library only calls these methods; the CLI turns them into a Rich display or
plain log lines (cbgen.cli.display)."""

from __future__ import annotations

from typing import Protocol


class ProgressSink(Protocol):
    def stage(self, message: str) -> None: ...
    def start(self, total: int | None, unit: str = "sequences") -> None: ...
    def advance(self, done: int, prompt_tokens: int, generated_tokens: int, failed: int) -> None: ...
    def finish(self) -> None: ...


class NullProgress:
    """Reports nothing (--quiet, and library use without a sink)."""

    def stage(self, message: str) -> None: ...
    def start(self, total: int | None, unit: str = "sequences") -> None: ...
    def advance(self, done: int, prompt_tokens: int, generated_tokens: int, failed: int) -> None: ...
    def finish(self) -> None: ...


def plural(count: int, noun: str) -> str:
    """'1 shard', '2 shards', '0 shards'."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
