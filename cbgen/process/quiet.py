"""Other libraries' logging and progress bars, quietened while one of cbgen's calls runs and put back after it.

cbgen shows its own progress and records every failed request itself, so transformers' and datasets' bars, advice
and the continuous-batching engine's tracebacks would only break its display (CBGEN_DEBUG=1 keeps the logs). A
program that uses cbgen as a library keeps its own settings: they are changed when the first of cbgen's calls starts
and restored when the last one in flight ends (calls may overlap, in threads).
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


@contextmanager
def quiet(library: str) -> Iterator[None]:
    """`library`'s ("transformers" or "datasets") logging and progress bars quietened while the block runs."""
    with _lock:
        if _depth[library] == 0:
            _restore[library] = _QUIETERS[library]()
        _depth[library] += 1
    try:
        yield
    finally:
        with _lock:
            _depth[library] -= 1
            if _depth[library] == 0:
                _restore.pop(library)()
