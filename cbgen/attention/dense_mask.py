"""The engine's dense attention mask, which cbgen's per-sequence attention never reads: not built while it serves.

For `sdpa`, transformers' continuous batching keeps one dense mask of the model's dtype, [max_batch_tokens, every
token the cache can hold + max_batch_tokens], allocated with the batch processor, written in full when it resets,
and refilled over the step's [query tokens, keys] corner before every forward pass. Its size follows the cache, not
the work: for HumanEval's 164 prompts on the embedded model (a 512-block cache of 256-token pages, 1,024 batch
tokens) it is 1,024 x 132,096 x 2 bytes = 258 MB, resident from the warm-up on (measured with `mincore` and smaps on
a 2-core Intel Xeon, Sapphire Rapids). The per-sequence attention rebuilds each request's causal (and sliding-window)
structure from the cumulative sequence lengths and ignores that mask, so while it serves the `sdpa` name and no
compiled forward pass could reach the stock function, the manager is built without one: transformers then passes
`is_causal=True` and no mask, and the model makes its own [query tokens, query tokens] mask, which is ignored too.

The stock function cannot attend a paged batch without the engine's mask, so a call the per-sequence path would hand
it in that state raises instead of attending across requests (`refuse_stock_without_mask`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cbgen.attention.support import paged_cache_class, serving

_lock = threading.Lock()
_depth = 0
_original: Any = None


def mask_unneeded(cb_config: Any) -> bool:
    """Whether a manager with this resolved ContinuousBatchingConfig can run without the dense mask: cbgen's
    per-sequence attention serves `sdpa` now, and no forward pass is compiled."""
    if paged_cache_class() is None or not serving("sdpa"):
        return False
    return all(getattr(cb_config, name, None) is None for name in ("varlen_compile_config", "decode_compile_config"))


@contextmanager
def without_dense_mask(cb_config: Any) -> Iterator[bool]:
    """Around the building of a manager's batch processor (its warm-up): where `mask_unneeded(cb_config)`, transformers
    is told that `sdpa` needs no attention mask, so none is allocated. Yields whether it was."""
    global _depth, _original
    if not mask_unneeded(cb_config):
        yield False
        return
    from transformers.generation.continuous_batching import input_outputs

    with _lock:
        if _depth == 0:
            _original = input_outputs.attn_mask_is_needed
            original = _original
            input_outputs.attn_mask_is_needed = lambda config: (
                False if getattr(config, "_attn_implementation", None) == "sdpa" else original(config))
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                input_outputs.attn_mask_is_needed = _original
                _original = None


def refuse_stock_without_mask(is_causal: bool | None, cache: Any) -> None:
    """Raises when a continuous-batching call built without the dense mask would go to the stock `sdpa` function (the
    engine passes `is_causal=True` to `sdpa` only then)."""
    cache_class = paged_cache_class()
    if is_causal and cache_class is not None and isinstance(cache, cache_class):
        raise RuntimeError("cbgen's per-sequence attention cannot compute this continuous-batching call, and the "
                           "engine was built without the dense mask the stock attention needs; run with "
                           "--attn-implementation sdpa")
