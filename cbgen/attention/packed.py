"""cbgen's compiled attention for rows packed end to end in one forward pass: the scorer's (cbgen.score), where every
row is a whole sequence and nothing is cached.

The scorer lays its rows one after another in a single sequence (no padding) and hands the forward pass the kernel's
request table (`PACKED_KWARG`): a plain row is one request over its own tokens; a row whose continuations sit side
by side behind its context is one request for the context and one per continuation, which reads the context's keys
(by their places in this step's keys, the `read_index`) and then its own. The compiled kernel
(cbgen/kernels/paged_attention.cpp) attends them all in one call per layer, each row from its own keys only, in a
fixed order: a row's scores are the same bits whatever rows share its forward pass, and however many.

Bound under `sdpa` for one model (cbgen.attention.registry) while a scoring scope holds it; a call without the
table, or one the kernel does not serve, goes to the stock function.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cbgen.attention import registry
from cbgen.attention.compiled import DTYPES, KERNEL
from cbgen.attention.per_sequence import sliding_window_of

PACKED_KWARG = "cbgen_packed_rows"  # (requests [n, 5] int64, read_index [keys] int64) of the forward pass

_NO_WRITES = torch.empty(0, dtype=torch.int64)


def packed_rows_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Drop-in for transformers' `sdpa_attention_forward` over packed rows: the same arguments and return value
    ([1, tokens, heads, dim]); the mask is not read (the request table says who attends what)."""
    layout = kwargs.pop(PACKED_KWARG, None)
    if layout is None:  # not the scorer's pass: the stock function, as if nothing were bound
        stock = registry.stock("sdpa")
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)
    layer = sliding_window_of(getattr(module, "config", None), getattr(module, "layer_idx", None))
    if layer is None or dropout or query.dim() != 4 or query.shape[0] != 1 or query.dtype not in DTYPES \
            or query.device.type != "cpu" or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        # planning keeps packed rows from models the kernel does not serve: the stock function could not keep the
        # rows apart (the pass has no mask), so this is refused rather than attended across rows
        raise RuntimeError(f"packed rows reached an attention the compiled kernel does not serve "
                           f"({type(module).__name__}, layer {getattr(module, 'layer_idx', '?')})")
    requests, read_index = layout
    tokens, head_dim = query.shape[2], query.shape[-1]
    out = query.new_empty(tokens, query.shape[1], head_dim)
    # the step's own keys and values, as the rows of a cache that the continuations read their context from
    k_rows, v_rows = key[0].transpose(0, 1), value[0].transpose(0, 1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    kernel: Any = getattr(torch.ops.cbgen_kernels, KERNEL)
    kernel(out, query, key, value, k_rows, v_rows, read_index, _NO_WRITES, requests, layer[1] or 0, scale)
    return out.unsqueeze(0), None


@contextmanager
def packed_rows_attention(model: torch.nn.Module) -> Iterator[None]:
    """`model`'s `sdpa` calls attend packed rows with the compiled kernel while the block runs (loaded in this
    process first)."""
    from cbgen.kernels import kernel

    built = kernel(KERNEL)
    if not built.loaded:
        raise RuntimeError(f"cbgen's compiled attention is not available: {built.detail}")
    with registry.bound(model, "sdpa", packed_rows_forward):
        yield
