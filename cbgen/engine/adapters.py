"""Rows of several LoRA adapters through one loaded model: each adapter's requests run together, its update merged
into the base weights while they do (cbgen.model.adapters), then the next adapter's.

A request names its adapter (`Request.adapter`; None: the job's own). A job with one adapter runs all its requests
with it merged. A job whose rows pick among several takes its requests a window at a time (WINDOW, in their order:
prefix-aware, cbgen.render.prompts), and runs each window's requests adapter by adapter, in the order the adapters
first appear, each group through a fresh run of the engine (or scorer) over the merged weights.

Why merged and grouped, not each row's low-rank product added to the base layers in one batch (vLLM's way): the
merged weights run every kernel cbgen has (fused layers, compiled linear blocks, batch invariance) unchanged and give
exactly what PEFT's merged model gives, and a row's bits depend on no other row's adapter. The price is an engine
start and a merge per group of a window, and smaller batches than one engine over all rows would have (measured in
docs/adapters.md).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from cbgen.model.adapters import Adapter, Adapters, applied, weights_held
from cbgen.records import Request

WINDOW = 4096  # requests grouped by adapter at a time: each group one engine run (a start, a merge)

T = TypeVar("T")


def by_adapter(model: Any, adapters: Adapters | None, requests: Iterable[Request | None],
               run: Callable[[Iterable[Request | None]], Iterator[T]], stop: threading.Event | None = None,
               window: int = WINDOW) -> Iterator[T]:
    """What `run` yields for `requests`, each run with its adapter merged into `model` (see the module); once `stop`
    is set no further group starts (the one running stops as `run` does). No adapters: `run(requests)`."""
    with weights_held(model):  # from here to the end, no other thread runs on (or merges into) these weights
        yield from _by_adapter(model, adapters, requests, run, stop, window)


def _by_adapter(model: Any, adapters: Adapters | None, requests: Iterable[Request | None],
                run: Callable[[Iterable[Request | None]], Iterator[T]], stop: threading.Event | None,
                window: int) -> Iterator[T]:
    if adapters is None:
        yield from run(requests)
        return
    if not adapters.named:  # one adapter for every row: merged once for the whole run
        with applied(model, adapters.default):
            yield from run(requests)
        return
    source = iter(requests)
    while chunk := list(itertools.islice(source, window)):
        groups: dict[Adapter | None, list[Request | None]] = {}
        for request in chunk:
            groups.setdefault(_adapter_of(adapters, request), []).append(request)
        for adapter, group in groups.items():
            if stop is not None and stop.is_set():
                return
            with applied(model, adapter):
                yield from run(group)


def _adapter_of(adapters: Adapters, request: Request | None) -> Adapter | None:
    """The adapter a request runs with; None (no merge) for the base model's rows and for requests that run nothing
    (answered by the result cache, or refused), which go with them."""
    if request is None or request.answered is not None or request.error is not None:
        return None
    return adapters.pick(request.adapter)
