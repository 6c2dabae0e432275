"""The engine's dense attention mask, which cbgen's per-sequence attention never reads: not built while it serves.

For `sdpa`, transformers' continuous batching keeps one dense mask of the model's dtype, [max_batch_tokens, every
token the cache can hold + max_batch_tokens], allocated with the batch processor, written in full when it resets,
and refilled over the step's [query tokens, keys] corner before every forward pass. Its size follows the cache, not
the work: for HumanEval's 164 prompts on the embedded model (a 512-block cache of 256-token pages, 1,024 batch
tokens) it is 1,024 x 132,096 x 2 bytes = 258 MB, resident from the warm-up on (measured with `mincore` and smaps on
a 2-core Intel Xeon, Sapphire Rapids). The per-sequence attention rebuilds each request's causal (and sliding-window)
structure from the cumulative sequence lengths and ignores that mask, so while it serves the `sdpa` name and no
compiled forward pass could reach the stock function (the plan decides: cbgen.engine.setup), the manager is built
without one: transformers then passes `is_causal=True` and no mask, and the model makes its own [query tokens, query
tokens] mask, which is ignored too. transformers asks one process-wide function whether a config needs the mask; while
an engine skips it, that function is cbgen's dispatcher (cbgen.process.shared_patch), which answers for the configs of
the models whose engines skip it and asks transformers' own for every other.

The stock function cannot attend a paged batch without the engine's mask, so a call the per-sequence path would hand
it in that state raises instead of attending across requests (`refuse_stock_without_mask`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cbgen.attention.registry import model_configs
from cbgen.attention.support import paged_cache_class
from cbgen.process.shared_patch import SharedPatch

_lock = threading.Lock()
_skipped: dict[int, int] = {}  # id(config) -> engines skipping its mask


def _module() -> Any:
    from transformers.generation.continuous_batching import input_outputs

    return input_outputs


def _needed(config: Any) -> bool:
    """transformers' `attn_mask_is_needed`, answered False for `sdpa` configs whose engine skips the mask."""
    if id(config) in _skipped and getattr(config, "_attn_implementation", None) == "sdpa":
        return False
    return _PATCH.original(config)


_PATCH = SharedPatch("transformers' attn_mask_is_needed", lambda: _module().attn_mask_is_needed,
                     lambda value: setattr(_module(), "attn_mask_is_needed", value), _needed)


def built_for(config: Any) -> bool:
    """Whether a manager built now for a model with this config would build the dense mask."""
    return _module().attn_mask_is_needed(config)


@contextmanager
def skipped(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs, managers built for `model` allocate no dense `sdpa` mask (only cbgen's per-sequence
    attention may serve it then: the caller's plan says so)."""
    keys = [id(config) for config in model_configs(model)]
    with _lock:
        for key in keys:
            _skipped[key] = _skipped.get(key, 0) + 1
    _PATCH.hold()
    try:
        yield
    finally:
        _PATCH.release()
        with _lock:
            for key in keys:
                if _skipped[key] > 1:
                    _skipped[key] -= 1
                else:
                    del _skipped[key]


def refuse_stock_without_mask(is_causal: bool | None, cache: Any) -> None:
    """Raises when a continuous-batching call built without the dense mask would go to the stock `sdpa` function (the
    engine passes `is_causal=True` to `sdpa` only then)."""
    cache_class = paged_cache_class()
    if is_causal and cache_class is not None and isinstance(cache, cache_class):
        raise RuntimeError("cbgen's per-sequence attention cannot compute this continuous-batching call, and the "
                           "engine was built without the dense mask the stock attention needs; run with "
                           "--attn-implementation sdpa")
