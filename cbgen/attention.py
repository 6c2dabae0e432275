"""Per-sequence attention for transformers' continuous batching on CPU.

What: an attention function for the continuous-batching engine (`ContinuousBatchingManager`, `generate_batch`) that
attends each request only to its own keys: all single-token queries of a step (decode) as one batched SDPA over each
request's own KV, padded to the longest with a key mask, and every longer query chunk (prefill, chunked prefill) as
one causal SDPA of its own. Grouped-query heads are never copied: decode folds the query heads onto their KV head and
prefill uses `enable_gqa=True`.

Why: on CPU the engine runs as `paged|sdpa`, whose attention scores the whole packed batch against the keys of every
request with one dense mask: a decode step of P requests of length L costs O(P²·L) and discards (P-1)/P of it, and
GQA is expanded with `repeat_kv`. That attention was 70% of a decode step at 64 sequences (see DESIGN.md §2).

How it is selected: the engine accepts only `sdpa`, `paged|eager` or flash names, so the function is registered under
`"sdpa"` with the public `transformers.AttentionInterface.register`, but only inside `per_sequence_attention(model)`,
which puts the previous function back on exit. The registry is process-wide, so the function serves every `sdpa` call
while installed and hands each call that it was not built for to the stock function unchanged: calls without a paged
cache (plain `model.generate`), other devices, training (dropout), torch.compile tracing, soft-capping, position bias,
attention sinks or any keyword argument it does not know, attention types other than full and sliding-window, and
batches whose lengths do not match the layout it expects. It relies on the engine's argument layout, which is checked
against the transformers versions in `VALIDATED_TRANSFORMERS`; with any other version it never installs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

VALIDATED_TRANSFORMERS: tuple[tuple[int, int], ...] = ((5, 23),)
"""transformers (major, minor) versions whose continuous-batching argument layout this module was checked against."""

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Keyword arguments the engine or the supported models pass that do not change what attention computes. Any other
# keyword with a value (e.g. `s_aux` attention sinks) sends the call to the stock function.
_KNOWN_KWARGS = frozenset(
    {
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "read_index",
        "write_index",
        "block_table",
        "logits_indices",
        "logits_processor_args",
        "position_ids",
        "use_cache",
        "sliding_window",
        "output_attentions",
        "softcap",
    }
)


# ------------------------------------------------------------------------------------------------------------------ #
# Availability


@lru_cache(maxsize=8)
def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string, or None when it cannot be read."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return (release[0], release[1]) if len(release) >= 2 else None


def _transformers_version() -> tuple[int, int] | None:
    import transformers

    return _release(transformers.__version__)


def _paged_cache_class() -> type | None:
    """The engine's cache class, or None when this transformers version is not one we validated."""
    if _transformers_version() not in VALIDATED_TRANSFORMERS:
        return None
    try:
        from transformers.generation.continuous_batching import PagedAttentionCache
    except ImportError:
        return None
    return PagedAttentionCache


def _layer_types(config: Any) -> list[str]:
    """The attention type of each layer, as the engine's cache groups them (one KV layout per type)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    attention_type = SLIDING_ATTENTION if getattr(config, "sliding_window", None) is not None else FULL_ATTENTION
    return [attention_type] * int(getattr(config, "num_hidden_layers", 0) or 0)


def cpu_attention_unavailable_reason(model: torch.nn.Module) -> str | None:
    """Why `per_sequence_attention(model)` would leave the stock attention in place, or None when it applies."""
    version = _transformers_version()
    if version not in VALIDATED_TRANSFORMERS:
        import transformers

        validated = ", ".join(f"{major}.{minor}" for major, minor in VALIDATED_TRANSFORMERS)
        return f"transformers {transformers.__version__} is not a validated version ({validated})"
    if _paged_cache_class() is None:
        return "transformers has no continuous-batching PagedAttentionCache"
    if (_release(torch.__version__) or (0, 0)) < (2, 5):
        return f"torch {torch.__version__} predates enable_gqa in scaled_dot_product_attention (needs 2.5)"
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"the model uses attn_implementation={getattr(config, '_attn_implementation', None)!r}, not 'sdpa'"
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return "the model has no parameters"
    if device.type != "cpu":
        return f"the model is on {device.type}, and the per-sequence attention is for CPU"
    unknown = sorted(set(_layer_types(config)) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        return f"the model has attention types {unknown} that only the stock attention handles"
    for name in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"the model soft-caps attention logits ({name})"
    return None


def cpu_attention_available(model: torch.nn.Module) -> bool:
    """True when `per_sequence_attention(model)` would install the per-sequence attention for this model."""
    return cpu_attention_unavailable_reason(model) is None


# ------------------------------------------------------------------------------------------------------------------ #
# Installation


class _Installation:
    """The process-wide registration: counted, so nested or concurrent engines share one installation."""

    lock = threading.Lock()
    depth = 0
    stock: Callable[..., Any] | None = None  # what "sdpa" was before the first install


def _registered_sdpa() -> Callable[..., Any]:
    from transformers import AttentionInterface

    return AttentionInterface()["sdpa"]  # a fresh instance has no local overrides: this is the global entry


def _stock_sdpa() -> Callable[..., Any]:
    if _Installation.stock is not None:
        return _Installation.stock
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


@contextmanager
def per_sequence_attention(model: torch.nn.Module, *, required: bool = False) -> Iterator[bool]:
    """Serves the model's continuous-batching attention per sequence while the block runs; yields whether it does.

    Enter it around the whole life of a `ContinuousBatchingManager` (its generation thread looks the attention
    function up at every forward pass). On exit, the function that was registered under "sdpa" before is put back.
    When the model is not supported (see `cpu_attention_unavailable_reason`), nothing is installed and the block runs
    on the stock attention; with `required=True` that raises `RuntimeError` instead.
    """
    reason = cpu_attention_unavailable_reason(model)
    if reason is not None:
        if required:
            raise RuntimeError(f"per-sequence attention is not available: {reason}")
        logger.info("per-sequence attention not used: %s", reason)
        yield False
        return
    from transformers import AttentionInterface

    with _Installation.lock:
        if _Installation.depth == 0:
            current = _registered_sdpa()
            _Installation.stock = None if current is per_sequence_sdpa_forward else current
            AttentionInterface.register("sdpa", per_sequence_sdpa_forward)
        _Installation.depth += 1
    try:
        yield True
    finally:
        with _Installation.lock:
            _Installation.depth -= 1
            if _Installation.depth == 0:
                stock, _Installation.stock = _stock_sdpa(), None
                if _registered_sdpa() is per_sequence_sdpa_forward:
                    AttentionInterface.register("sdpa", stock)
                else:
                    logger.warning("the 'sdpa' attention was replaced while cbgen's per-sequence attention was "
                                   "installed; leaving the replacement in place")


# ------------------------------------------------------------------------------------------------------------------ #
# The attention function


@dataclass
class _Batch:
    """Where each request of a packed batch lies in the query and key tensors (padding sequences left out)."""

    q_starts: list[int]
    q_lengths: list[int]
    k_starts: list[int]
    k_lengths: list[int]
    window: int | None  # sliding window of this layer, as the stock mask applies it, or None


def _sliding_window(config: Any, layer_idx: int) -> tuple[str, int | None] | None:
    """The layer's attention type and the window the stock mask applies to it; None when unsupported."""
    layer_types = _layer_types(config)
    if layer_idx >= len(layer_types):
        return None
    layer_type = layer_types[layer_idx]
    if layer_type == FULL_ATTENTION:
        return layer_type, None
    if layer_type != SLIDING_ATTENTION:
        return None
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int):
        return None
    return layer_type, (window if window > 1 else None)  # the stock mask ignores windows of 1


def _plan(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> _Batch | None:
    """Reads the packed layout from the engine's arguments, or None when the call is not one this path handles."""
    config = getattr(module, "config", None)
    layer_idx = getattr(module, "layer_idx", None)
    if config is None or not isinstance(layer_idx, int):
        return None
    layer = _sliding_window(config, layer_idx)
    if layer is None:
        return None
    layer_type, window = layer
    requested = kwargs.get("sliding_window")
    if requested is not None and requested != getattr(config, "sliding_window", None):
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if isinstance(cu_k, dict):
        cu_k = cu_k.get(layer_type)
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor) or cu_q.shape != cu_k.shape:
        return None
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    if bounds_q[0] != 0 or bounds_k[0] != 0 or bounds_q[-1] > query.shape[2]:
        return None
    batch = _Batch([], [], [], [], window)
    for i in range(len(bounds_q) - 1):
        q_length, k_length = bounds_q[i + 1] - bounds_q[i], bounds_k[i + 1] - bounds_k[i]
        if q_length == 0 and k_length == 0:
            continue  # padding sequence
        if q_length <= 0 or k_length < q_length:
            return None
        batch.q_starts.append(bounds_q[i])
        batch.q_lengths.append(q_length)
        batch.k_starts.append(bounds_k[i])
        batch.k_lengths.append(k_length)
    if not batch.q_lengths:
        return None
    # The keys of a request are its past followed by its new tokens: check the count against the query positions
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor):
        if position_ids.dim() != 2 or position_ids.shape[0] != 1:
            return None
        pasts = position_ids[0, batch.q_starts].tolist()
        for past, q_length, k_length in zip(pasts, batch.q_lengths, batch.k_lengths):
            kept = past if layer_type == FULL_ATTENTION else min(past, (config.sliding_window or 1) - 1)
            if k_length != q_length + kept:
                return None
    return batch


def _handles(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    position_bias: torch.Tensor | None,
    cache: Any,
    kwargs: dict[str, Any],
) -> bool:
    """Whether this call is a plain paged continuous-batching call on CPU, the only kind this path computes."""
    cache_class = _paged_cache_class()
    if cache_class is None or not isinstance(cache, cache_class):
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if dropout or position_bias is not None or kwargs.get("block_table") is not None:
        return False
    if kwargs.get("softcap") is not None or kwargs.get("output_attentions"):
        return False
    if any(value_ is not None for name, value_ in kwargs.items() if name not in _KNOWN_KWARGS):
        return False
    if getattr(module, "is_causal", True) is False:
        return False
    if query.device.type != "cpu" or query.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1:
        return False
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    return num_kv_heads > 0 and num_heads % num_kv_heads == 0 and key.shape[-1] == query.shape[-1]


def per_sequence_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Drop-in for transformers' `sdpa_attention_forward` that attends each request of a paged batch on its own.

    Same arguments and return value as the stock function ([1, heads, tokens, dim] query, [1, kv_heads, tokens, dim]
    keys and values; returns [1, tokens, heads, dim]). The dense `attention_mask` the engine builds is ignored: the
    per-request causal (and sliding-window) structure is rebuilt from the cumulative sequence lengths.
    """
    stock = _stock_sdpa()
    batch = None
    if _handles(module, query, key, value, dropout, position_bias, cache, kwargs):
        batch = _plan(module, query, key, kwargs)
    if batch is None:
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, position_bias=position_bias, cache=cache, **kwargs)

    # Same cache update as the stock function: writes the new KV and returns each request's past + new KV, packed
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    if batch.k_starts[-1] + batch.k_lengths[-1] > key.shape[2]:
        raise RuntimeError(
            f"per-sequence attention: the paged cache returned {key.shape[2]} keys for cumulative key lengths that "
            f"end at {batch.k_starts[-1] + batch.k_lengths[-1]}; run without cbgen's per-sequence attention"
        )

    num_tokens = query.shape[2]
    out = query.new_empty(num_tokens, query.shape[1], value.shape[-1])
    if sum(batch.q_lengths) < num_tokens:
        out.zero_()  # padding tokens: never read, but keep them finite
    decode = [i for i, length in enumerate(batch.q_lengths) if length == 1]
    if decode:
        _attend_decode(query, key, value, batch, decode, scaling, out)
    for i, q_length in enumerate(batch.q_lengths):
        if q_length > 1:
            _attend_chunk(query, key, value, batch, i, scaling, out)
    return out.unsqueeze(0), None


def _attend_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: _Batch,
    requests: list[int],
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """All single-token queries at once: batch = requests, each over its own keys (padded to the longest, masked).

    The query heads that share a KV head become that head's query rows ([B, kv_heads, group, dim]), so GQA needs no
    copy of the keys and SDPA keeps its fast path (measured faster on CPU than `enable_gqa=True` for one token).
    """
    num_heads, num_kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[-1]
    group = num_heads // num_kv_heads
    n = len(requests)
    q_rows = [batch.q_starts[i] for i in requests]
    k_starts = [batch.k_starts[i] for i in requests]
    k_lengths = [batch.k_lengths[i] for i in requests]
    longest = max(k_lengths)
    keys_by_token, values_by_token = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [tokens, kv_heads, dim]

    contiguous_rows = q_rows == list(range(q_rows[0], q_rows[0] + n))
    equal = all(length == longest for length in k_lengths)
    adjacent = all(start == k_starts[0] + j * longest for j, start in enumerate(k_starts))
    if equal and adjacent:
        span = slice(k_starts[0], k_starts[0] + n * longest)
        k = keys_by_token[span].view(n, longest, num_kv_heads, head_dim).transpose(1, 2)
        v = values_by_token[span].view(n, longest, num_kv_heads, -1).transpose(1, 2)
    else:
        offsets = torch.arange(longest)
        lengths = torch.tensor(k_lengths)
        index = torch.tensor(k_starts)[:, None] + torch.minimum(offsets[None, :], (lengths - 1)[:, None])
        index = index.flatten().to(key.device)
        k = keys_by_token.index_select(0, index).view(n, longest, num_kv_heads, head_dim).transpose(1, 2)
        v = values_by_token.index_select(0, index).view(n, longest, num_kv_heads, -1).transpose(1, 2)

    mask = None
    window_binds = batch.window is not None and longest > batch.window
    if not equal or window_binds:
        positions = torch.arange(longest)[None, :]
        lengths = torch.tensor(k_lengths)[:, None]
        keep = positions < lengths
        if window_binds:
            keep &= positions >= lengths - batch.window
        mask = keep[:, None, None, :].to(query.device)  # [B, 1, 1, keys], shared by every head

    if contiguous_rows:
        q = query[0, :, q_rows[0] : q_rows[0] + n]  # [heads, B, dim]
    else:
        q = query[0].index_select(1, torch.tensor(q_rows, device=query.device))
    q = q.transpose(0, 1).reshape(n, num_kv_heads, group, head_dim)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # [B, kv_heads, group, dim]
    attended = attended.reshape(n, num_heads, -1)
    if contiguous_rows:
        out[q_rows[0] : q_rows[0] + n] = attended
    else:
        out.index_copy_(0, torch.tensor(q_rows, device=out.device), attended)


def _attend_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: _Batch,
    request: int,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """One request's query chunk over its cached prefix and itself, causal within the chunk."""
    q_start, q_length = batch.q_starts[request], batch.q_lengths[request]
    k_start, k_length = batch.k_starts[request], batch.k_lengths[request]
    q = query[:, :, q_start : q_start + q_length]
    k = key[:, :, k_start : k_start + k_length]
    v = value[:, :, k_start : k_start + k_length]
    past = k_length - q_length  # the chunk's queries are the last q_length keys
    window = batch.window
    if past == 0 and (window is None or q_length <= window):
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        rows = torch.arange(q_length)[:, None] + past  # each query's own key index
        columns = torch.arange(k_length)[None, :]
        keep = columns <= rows
        if window is not None:
            keep &= columns > rows - window
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep.to(query.device), scale=scaling, enable_gqa=True
        )
    out[q_start : q_start + q_length] = attended[0].transpose(0, 1)
