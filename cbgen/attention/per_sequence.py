"""The per-sequence attention function: a drop-in for transformers' `sdpa_attention_forward` that attends each request
of a paged continuous batch to its own keys only (see cbgen.attention for why and when)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cbgen.attention import registry
from cbgen.attention.dense_mask import refuse_stock_without_mask
from cbgen.attention.invariant import attend_invariant
from cbgen.attention.layout import StepLayout
from cbgen.attention.paged_decode import PageRead, layer_cache, padded_positions, read_requests
from cbgen.attention.pass_memo import remembered
from cbgen.attention.support import FULL_ATTENTION, SLIDING_ATTENTION, layer_types, paged_cache_class

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
        "output_router_logits",  # MoE models (Mixtral, Qwen3-MoE) pass it to every layer, attention included
    }
)


def sliding_window_of(config: Any, layer_idx: int | None) -> tuple[str, int | None] | None:
    """The layer's attention type and the window the stock mask applies to it; None when unsupported."""
    if config is None or not isinstance(layer_idx, int):
        return None
    types = layer_types(config)
    if layer_idx >= len(types):
        return None
    layer_type = types[layer_idx]
    if layer_type == FULL_ATTENTION:
        return layer_type, None
    if layer_type != SLIDING_ATTENTION:
        return None
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int):
        return None
    return layer_type, (window if window > 1 else None)  # the stock mask ignores windows of 1


def step_layout(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                kwargs: dict[str, Any]) -> StepLayout | None:
    """Reads the packed layout from the engine's arguments, or None when the call is not one this path handles.
    Worked out once per forward pass and layer type (cbgen.attention.pass_memo)."""
    config = getattr(module, "config", None)
    layer_idx = getattr(module, "layer_idx", None)
    if config is None or not isinstance(layer_idx, int):
        return None
    layer = sliding_window_of(config, layer_idx)
    if layer is None:
        return None
    layer_type, window = layer
    requested = kwargs.get("sliding_window")
    if requested is not None and requested != getattr(config, "sliding_window", None):
        return None
    memo_key = ("plan", id(config), layer_type, window, query.shape[2], id(kwargs.get("cu_seq_lens_q")),
                id(kwargs.get("cu_seq_lens_k")), id(kwargs.get("position_ids")))
    return remembered(memo_key, lambda: _layout(config, layer_type, window, query.shape[2], kwargs))


def _layout(config: Any, layer_type: str, window: int | None, num_tokens: int,
            kwargs: dict[str, Any]) -> StepLayout | None:
    """The batch's layout for the layers of one type, from the engine's arguments (the same for every such layer of a
    forward pass)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if isinstance(cu_k, dict):
        cu_k = cu_k.get(layer_type)
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor) or cu_q.shape != cu_k.shape:
        return None
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    if bounds_q[0] != 0 or bounds_k[0] != 0 or bounds_q[-1] > num_tokens:
        return None
    batch = StepLayout([], [], [], [], window, [])
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
            batch.first_positions.append(past - kept)  # type: ignore[union-attr]
    elif layer_type == FULL_ATTENTION:
        batch.first_positions = [0] * len(batch.q_lengths)  # a full layer's keys start at its request's first token
    else:
        batch.first_positions = None
    return batch


def handled_call(
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
    cache_class = paged_cache_class()
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
    module: Any,  # the model's attention module (its layer_idx, num_key_value_groups, ...)
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    cache: Any = None,
    _invariant: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Drop-in for transformers' `sdpa_attention_forward` that attends each request of a paged batch on its own.

    Same arguments and return value as the stock function ([1, heads, tokens, dim] query, [1, kv_heads, tokens, dim]
    keys and values; returns [1, tokens, heads, dim]). The dense `attention_mask` the engine builds is ignored: the
    per-request causal (and sliding-window) structure is rebuilt from the cumulative sequence lengths.
    `_invariant`: attend batch-invariantly (see `batch_invariant_sdpa_forward`).
    """
    stock = registry.stock("sdpa")
    batch = None
    if handled_call(module, query, key, value, dropout, position_bias, cache, kwargs):
        batch = step_layout(module, query, key, kwargs)
    if batch is None:
        refuse_stock_without_mask(is_causal, cache)
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, position_bias=position_bias, cache=cache, **kwargs)

    num_tokens = query.shape[2]
    out = query.new_empty(num_tokens, query.shape[1], value.shape[-1])
    if sum(batch.q_lengths) < num_tokens:
        out.zero_()  # padding tokens: never read, but keep them finite
    layer = layer_cache(cache, module.layer_idx, kwargs, batch.read_end, num_tokens)
    if _invariant:
        _attend_invariantly(module, query, key, value, batch, scaling, out, layer, cache, kwargs)
        return out.unsqueeze(0), None
    if layer is None:
        _attend_packed(query, key, value, batch, scaling, out, cache.update(
            key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs))
        return out.unsqueeze(0), None
    # The new KV written as the stock update does, without its packed read-back: single-token requests read their
    # cache pages (cbgen.attention.paged_decode), a fresh prompt chunk attends its own new KV, a later chunk reads its
    # rows of the cache
    layer.write(key, value)
    if batch.decode:
        read = read_requests(layer, *batch.decode_keys, key.device)
        _attend_decode(query, key, value, batch, batch.decode, scaling, out, read)
    for i in batch.chunks:
        k, v = layer.read_chunk(key, value, batch.q_starts[i], batch.q_lengths[i], batch.k_starts[i],
                                batch.k_lengths[i])
        _attend_chunk(query, k, v, batch, i, scaling, out)
    return out.unsqueeze(0), None


def batch_invariant_sdpa_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`per_sequence_sdpa_forward` with every query token attended in a call shaped by its own position only
    (cbgen.attention.invariant): the same result whatever shares the batch. Calls the per-sequence path does not
    compute go to the stock function, as there."""
    return per_sequence_sdpa_forward(module, query, key, value, attention_mask, _invariant=True, **kwargs)


def _attend_invariantly(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: StepLayout,
                        scaling: float | None, out: torch.Tensor, layer: Any, cache: Any,
                        kwargs: dict[str, Any]) -> None:
    """The new KV written (through the layer's cache views, else the stock update), then every token read back from
    where it lies and attended by cbgen.attention.invariant."""
    if layer is not None:
        layer.write(key, value)
        if batch.read_end == 0:  # no request has a past (and the engine left the read index empty): the new KV
            attend_invariant(query, key[0].transpose(0, 1), value[0].transpose(0, 1), None, batch, scaling, out)
        else:
            attend_invariant(query, layer.k_cache, layer.v_cache, layer.read_index, batch, scaling, out)
        return
    packed_k, packed_v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    if batch.k_starts[-1] + batch.k_lengths[-1] > packed_k.shape[2]:
        raise RuntimeError("batch-invariant attention: the paged cache returned fewer keys than the batch's lengths; "
                           "run without --batch-invariant")
    attend_invariant(query, packed_k[0].transpose(0, 1), packed_v[0].transpose(0, 1), None, batch, scaling, out)


def _attend_packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: StepLayout,
                   scaling: float | None, out: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Every request over the stock update's packed read-back (each request's past + new KV, request by request):
    the path of layers whose cache this module does not read itself (sliding-window layers, an unexpected layout)."""
    key, value = packed
    if batch.k_starts[-1] + batch.k_lengths[-1] > key.shape[2]:
        raise RuntimeError(
            f"per-sequence attention: the paged cache returned {key.shape[2]} keys for cumulative key lengths that "
            f"end at {batch.k_starts[-1] + batch.k_lengths[-1]}; run without cbgen's per-sequence attention"
        )
    if batch.decode:
        _attend_decode(query, key, value, batch, batch.decode, scaling, out)
    for i in batch.chunks:
        span = slice(batch.k_starts[i], batch.k_starts[i] + batch.k_lengths[i])
        _attend_chunk(query, key[:, :, span], value[:, :, span], batch, i, scaling, out)


def _attend_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: StepLayout,
    requests: list[int],
    scaling: float | None,
    out: torch.Tensor,
    read: PageRead | None = None,
) -> None:
    """All single-token queries at once: batch = requests, each over its own keys (padded to the longest, masked).
    `read`: the requests' keys and values as read from the cache pages (cbgen.attention.paged_decode); else they are
    gathered here from the packed `key` and `value`.

    The query heads that share a KV head become that head's query rows ([B, kv_heads, group, dim]), so GQA needs no
    copy of the keys and SDPA keeps its fast path (measured faster on CPU than `enable_gqa=True` for one token).
    """
    num_heads, num_kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[-1]
    n = len(requests)
    q_rows = [batch.q_starts[i] for i in requests]
    k_lengths = [batch.k_lengths[i] for i in requests]
    longest = max(k_lengths)
    if read is None:
        read = PageRead(*_gather_padded(key, value, [batch.k_starts[i] for i in requests], k_lengths, longest),
                        None, "packed")
    contiguous_rows = q_rows == list(range(q_rows[0], q_rows[0] + n))
    if contiguous_rows:
        q = query[0, :, q_rows[0] : q_rows[0] + n]  # [heads, B, dim]
    else:
        q = query[0].index_select(1, torch.tensor(q_rows, device=query.device))
    q = q.transpose(0, 1).reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if read.rows is not None:  # rows of pages no request owns: a zero query, attending their whole length
        q = q.new_zeros(read.keys.shape[0], *q.shape[1:]).index_copy_(0, read.rows, q)
    memo_key = ("decode mask", id(batch), tuple(requests), id(read.rows), read.keys.shape[0])
    mask = remembered(memo_key, lambda: _decode_mask(k_lengths, read, longest, batch.window, query.device))
    attended = F.scaled_dot_product_attention(q, read.keys, read.values, attn_mask=mask, scale=scaling)
    if read.rows is not None:
        attended = attended.index_select(0, read.rows)
    attended = attended.reshape(n, num_heads, -1)  # from [B, kv_heads, group, dim]
    if contiguous_rows:
        out[q_rows[0] : q_rows[0] + n] = attended
    else:
        out.index_copy_(0, torch.tensor(q_rows, device=out.device), attended)


def _decode_mask(k_lengths: list[int], read: PageRead, longest: int, window: int | None,
                 device: torch.device) -> torch.Tensor | None:
    """[rows, 1, 1, keys] keeping each row's own keys (and only its window's), or None when every key is kept. Rows
    of no request keep all theirs."""
    lengths = torch.tensor(k_lengths)
    if read.rows is not None:
        lengths = torch.full((read.keys.shape[0],), longest).index_copy_(0, read.rows.cpu(), lengths)
    binding = window if window is not None and longest > window else None  # the window cuts off keys
    if bool((lengths == longest).all()) and binding is None:
        return None
    positions = torch.arange(longest)[None, :]
    keep = positions < lengths[:, None]
    if binding is not None:
        keep &= positions >= lengths[:, None] - binding
    return keep[:, None, None, :].to(device)  # shared by every head


def _gather_padded(key: torch.Tensor, value: torch.Tensor, k_starts: list[int], k_lengths: list[int],
                   longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's keys and values from the packed read-back, padded to the longest with its last row
    ([B, kv_heads, longest, dim]); a view when the requests are equally long and adjacent."""
    n, num_kv_heads, head_dim = len(k_starts), key.shape[1], key.shape[-1]
    keys_by_token, values_by_token = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [tokens, kv_heads, dim]
    equal = all(length == longest for length in k_lengths)
    adjacent = all(start == k_starts[0] + j * longest for j, start in enumerate(k_starts))
    if equal and adjacent:
        span = slice(k_starts[0], k_starts[0] + n * longest)
        return (keys_by_token[span].view(n, longest, num_kv_heads, head_dim).transpose(1, 2),
                values_by_token[span].view(n, longest, num_kv_heads, -1).transpose(1, 2))
    index = padded_positions(k_starts, k_lengths, longest).to(key.device)
    return (keys_by_token.index_select(0, index).view(n, longest, num_kv_heads, head_dim).transpose(1, 2),
            values_by_token.index_select(0, index).view(n, longest, num_kv_heads, -1).transpose(1, 2))


def _attend_chunk(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: StepLayout,
    request: int,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """One request's query chunk over its cached prefix and itself (`k`, `v`: [1, kv_heads, its keys, dim]), causal
    within the chunk."""
    q_start, q_length = batch.q_starts[request], batch.q_lengths[request]
    k_length = batch.k_lengths[request]
    q = query[:, :, q_start : q_start + q_length]
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
