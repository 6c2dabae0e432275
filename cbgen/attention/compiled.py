"""cbgen's compiled paged attention (cbgen/kernels/paged_attention.cpp) as the engine's attention function: one call
per layer per step for every query row, decode tokens and prompt chunks together, reading keys and values where
they lie in transformers' paged cache and writing the step's new ones there, invariant by construction.

Why: the eager per-sequence path (cbgen.attention.per_sequence) issues a CPU flash-attention call per group of
requests and copies strided cache views for them; its batch-invariant variant pads every token's keys to a bucket
and attends each as its own SDPA row. On a 2-core AMD EPYC Zen 4 (bf16, the embedded model's shape: 9 query and 3
KV heads of 64), a decode step of 64 sequences of ~160 tokens spends about 0.5 ms a layer in the kernel against
about 2 ms in CPU flash attention alone, and every row is batch-invariant (the kernel's source says why).

When it serves: the same calls the per-sequence path computes (`handled_call`: a plain paged continuous-batching
call on CPU), with the layer's cache views readable (`_cache_views`). Anything else goes to the batch-invariant
eager path, which hands what it does not compute to the stock function in turn.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cbgen.attention.layout import StepLayout
from cbgen.attention.pass_memo import remembered
from cbgen.attention.per_sequence import batch_invariant_sdpa_forward, handled_call, step_layout

KERNEL = "paged_attention"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the kernel holds the head dimension in registers: one of these


def _requests(batch: StepLayout) -> torch.Tensor:
    """The kernel's request table: q_start, q_length, k_start, k_length, first_position per request."""
    assert batch.first_positions is not None
    return torch.tensor(list(zip(batch.q_starts, batch.q_lengths, batch.k_starts, batch.k_lengths,
                                 batch.first_positions)), dtype=torch.int64)


def _cache_views(cache: Any, layer_idx: int, kwargs: dict[str, Any], batch: StepLayout, key: torch.Tensor,
                 tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(k_cache, v_cache, read_index, write_index) of the layer: its token views of the paged cache and this step's
    indices; None when the layout is not the one the kernel reads."""
    allocator: Any = getattr(cache, "layer_to_allocator", {}).get(layer_idx)
    views = getattr(allocator, "_kv_token_views", None)
    if allocator is None or not isinstance(views, dict) or layer_idx not in views:
        return None
    k_cache, v_cache = views[layer_idx]
    try:
        read_index = kwargs["read_index"][allocator.index]
        write_index = kwargs["write_index"][allocator.index]
    except (KeyError, IndexError, TypeError):
        return None
    for index in (read_index, write_index):
        if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype != torch.int64 or \
                not index.is_contiguous():
            return None
    if write_index.numel() != tokens or read_index.numel() < batch.read_end:
        return None
    if k_cache.dtype != key.dtype or k_cache.dim() != 3 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return None
    return k_cache, v_cache, read_index, write_index


def compiled_sdpa_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, position_bias: torch.Tensor | None = None, cache: Any = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Drop-in for transformers' `sdpa_attention_forward` under continuous batching on CPU: the whole step in one
    kernel call. Same arguments and return value as the stock function; the dense mask is ignored (each request's
    causal and sliding-window structure comes from the cumulative lengths and positions)."""
    batch = None
    if handled_call(module, query, key, value, dropout, position_bias, cache, kwargs) and query.dtype in DTYPES:
        batch = step_layout(module, query, key, kwargs)
    views = None
    if batch is not None and batch.first_positions is not None:
        views = _cache_views(cache, module.layer_idx, kwargs, batch, key, query.shape[2])
    if batch is None or views is None:
        return batch_invariant_sdpa_forward(module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, is_causal=is_causal, position_bias=position_bias,
                                            cache=cache, **kwargs)
    k_cache, v_cache, read_index, write_index = views
    num_tokens, head_dim = query.shape[2], query.shape[-1]
    out = query.new_empty(num_tokens, query.shape[1], head_dim)
    if sum(batch.q_lengths) < num_tokens:
        out.zero_()  # padding tokens: never read, but keep them finite
    layout = batch
    requests = remembered(("kernel requests", id(layout)), lambda: _requests(layout))
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    kernel: Any = getattr(torch.ops.cbgen_kernels, KERNEL)  # registered when cbgen.kernels loaded the library
    kernel(out, query, key, value, k_cache, v_cache, read_index, write_index, requests, layout.window or 0, scale)
    return out.unsqueeze(0), None


def compiled_attention_unavailable_reason(model: torch.nn.Module) -> str | None:
    """Why the compiled attention cannot serve `model` (after cbgen's CPU attention applies to it), or None. Builds
    the kernel on first use (cbgen.kernels)."""
    model_config: Any = getattr(model, "config", None)
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // (heads or 1))
    if head_dim not in HEAD_DIMS:
        return f"its head dimension ({head_dim}) is not one the kernel holds ({', '.join(map(str, HEAD_DIMS))})"
    try:
        dtype = next(model.parameters()).dtype
    except StopIteration:
        return "the model has no parameters"
    if dtype not in DTYPES:
        return f"the model runs in {dtype}; the kernel computes float32, bfloat16 and float16"
    from cbgen.kernels import kernel

    built = kernel(KERNEL)
    return None if built.loaded else built.detail
