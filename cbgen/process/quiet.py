"""Other libraries' logging and progress bars, quietened while one of cbgen's calls runs and put back after it.

cbgen shows its own progress and records every failed request itself, so transformers' and datasets' bars, advice
and the continuous-batching engine's tracebacks would only break its display (CBGEN_DEBUG=1 keeps the logs). A
program that uses cbgen as a library keeps its own settings: they are changed when the first of cbgen's calls starts
and restored when the last one in flight ends (calls may overlap, in threads). An engine scope holds transformers'
(`hold`, `let_go`: cbgen.engine.changes.Quieted) and checks it (`problem`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cbgen.errors import debug_enabled

ENGINE_LOGGER = "ContinuousBatchingLogger"  # transformers' continuous-batching engine logs failed requests here

_lock = threading.Lock()
_depth = {"transformers": 0, "datasets": 0}
_restore: dict[str, Callable[[], None]] = {}
_before: dict[str, tuple] = {}  # each library's settings when the first call in flight quietened it


def _transformers_settings() -> tuple:
    from transformers.utils import logging as hf_logging

    return hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity(), logging.getLogger(ENGINE_LOGGER).level


def _datasets_settings() -> tuple:
    import datasets

    return (datasets.is_progress_bar_enabled(),)


def _transformers_quiet(settings: tuple) -> bool:
    bar, verbosity, engine = settings
    return not bar and (debug_enabled() or (verbosity >= logging.ERROR and engine >= logging.CRITICAL))


def _quiet_transformers() -> Callable[[], None]:
    from transformers.utils import logging as hf_logging

    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    engine = logging.getLogger(ENGINE_LOGGER)
    level = engine.level
    hf_logging.disable_progress_bar()
    if not debug_enabled():
        hf_logging.set_verbosity_error()
        engine.setLevel(logging.CRITICAL)

    def restore() -> None:
        if bar:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)
        engine.setLevel(level)

    return restore


def _quiet_datasets() -> Callable[[], None]:
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    return (lambda: datasets.enable_progress_bars()) if bars else (lambda: None)


_QUIETERS = {"transformers": _quiet_transformers, "datasets": _quiet_datasets}
_SETTINGS = {"transformers": _transformers_settings, "datasets": _datasets_settings}
_IS_QUIET = {"transformers": _transformers_quiet, "datasets": lambda settings: not settings[0]}


def hold(library: str) -> None:
    """`library`'s ("transformers" or "datasets") logging and progress bars quietened until `let_go`."""
    with _lock:
        if _depth[library] == 0:
            _before[library] = _SETTINGS[library]()
            _restore[library] = _QUIETERS[library]()
        _depth[library] += 1


def let_go(library: str) -> None:
    """Ends one `hold`: the last one in flight puts the library's settings back."""
    with _lock:
        _depth[library] -= 1
        if _depth[library] == 0:
            _restore.pop(library)()


def problem(library: str, held: bool) -> str | None:
    """What is wrong with `library`'s settings: not quiet while a call holds them (`held`), or not put back once no
    call holds them any more; None when they are as they should be."""
    with _lock:
        if _depth[library] == 0 and library not in _before:
            return None  # never quietened
        settings = _SETTINGS[library]()
        if held:
            return None if _IS_QUIET[library](settings) else f"{library}'s logging is not quiet: {settings}"
        if _depth[library] == 0 and settings != _before[library]:
            return f"{library}'s logging was not put back: {settings}, not {_before[library]}"
    return None


@contextmanager
def quiet(library: str) -> Iterator[None]:
    """`library`'s logging and progress bars quietened while the block runs."""
    hold(library)
    try:
        yield
    finally:
        let_go(library)
