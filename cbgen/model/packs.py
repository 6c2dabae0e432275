"""Weights packed once per loaded model: a kernel's own layout of a linear layer's weight, kept beside the weight for
as long as the weight lives, so that every engine of a process (the API's reused Generator, an engine restarted
after a dead loop, a bench's paths) starts without packing again. Packing took 0.11 s (bfloat16) to 0.23 s (float32)
of each engine start for the embedded SmolLM2-135M on a 2-core Intel Xeon, about 2 s for a 1B float32 model.

A pack is keyed by the weight tensor itself (held weakly) and checked against the weight's storage, shape, dtype and
version counter, which an in-place change through the tensor itself moves: a weight that changed is packed again.
A change made through `.data` (PEFT merges adapters so) moves no counter, and a merged projection's weight is another
tensor than the views its parts' changes go through: whoever changes weights so calls `clear()` (cbgen.model.adapters
does). The packs are a second copy of the packed weights while the model is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from cbgen.process.runtime import RUNTIME

_packs = RUNTIME.cache("packed weights", "weight -> {layout name: (its state, the pack)}", WeakIdKeyDictionary())


def _state(weight: torch.Tensor) -> tuple[Any, ...]:
    return (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight._version)


def kept(weight: torch.Tensor, layout: str, pack: Callable[[torch.Tensor], Any]) -> Any:
    """`pack(weight)`, computed once per weight (and `layout`, the name of what it is packed for) while the weight
    is unchanged."""
    state = _state(weight)
    with _packs.lock:
        entry = _packs.get(weight, {}).get(layout)
    if entry is not None and entry[0] == state:
        return entry[1]
    with torch.no_grad():
        packed = pack(weight)
    with _packs.lock:
        _packs.setdefault(weight, {})[layout] = (state, packed)
    return packed


def count() -> int:
    """How many weights hold packs now (for tests and for run.json)."""
    with _packs.lock:
        return len(_packs)


def clear() -> None:
    """Forgets every pack: for a change of weights that the version counter does not see (an adapter merged through
    `.data`, cbgen.model.adapters), so that the next engine packs the values the weights hold now."""
    with _packs.lock:
        _packs.clear()
