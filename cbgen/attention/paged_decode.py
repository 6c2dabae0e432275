"""The decode fast path of per-sequence attention: read each request's keys and values straight from its cache page.

In a step where every request decodes one token, the stock cache update writes the new keys and values, then reads
back every key of every request token by token (one index per token: ~9,000 rows per layer at 64 sequences of
~140 tokens), and the per-sequence path gathered those rows a second time to pad each request to the longest. Here
the write is the same, and the read is one gather of whole runs: request i's rows 0..longest-1 of its page. The
values attended are the same tensors as before, so the output is bitwise the same; profiled on a 2-core AVX2 CPU
(benchmarks/profile_step.py) the gathers were a fifth of a decode step at 64 sequences.

When, in a full-attention layer, every request's keys lie in one page from the page's first slot (a request no
longer than a page: 256 tokens by default), the read is one gather of whole pages' rows; otherwise (a request spans
pages) it is one gather of token rows, already padded, through the stock read index: still one gather, not two.
Anything unexpected returns None, for the caller to take the stock update. It reads private attributes of
transformers' paged cache, which is why cbgen's attention installs only with the transformers versions it was
checked against (support.VALIDATED_TRANSFORMERS).
"""

from __future__ import annotations

from typing import Any

import torch

from cbgen.attention.support import FULL_ATTENTION


def _allocator(cache: Any, layer_idx: int) -> Any:
    allocator = getattr(cache, "layer_to_allocator", {}).get(layer_idx)
    if allocator is None or getattr(allocator, "layer_type", None) != FULL_ATTENTION:
        return None
    views = getattr(allocator, "_kv_token_views", None)
    if not isinstance(views, dict) or layer_idx not in views or not isinstance(allocator.tokens_per_page, int):
        return None
    return allocator


def _pages(read_index: torch.Tensor, k_starts: list[int], k_lengths: list[int], page: int) -> torch.Tensor | None:
    """The page (in the layer's page view) holding each request's keys, or None when a request's keys do not fill
    one page from its first slot in order."""
    if max(k_lengths) > page:
        return None
    starts = torch.tensor(k_starts)
    lengths = torch.tensor(k_lengths)
    first = read_index[starts.to(read_index.device)].cpu()
    last = read_index[(starts + lengths - 1).to(read_index.device)].cpu()
    if bool(((first % page) != 0).any()) or not torch.equal(last - first, lengths - 1):
        return None
    return (first // page).to(read_index.device)


def padded_positions(k_starts: list[int], k_lengths: list[int], longest: int) -> torch.Tensor:
    """Where each request's keys lie in the packed read-back, padded to `longest` by repeating its last one:
    [requests * longest], request by request."""
    offsets = torch.arange(longest)[None, :]
    last = torch.tensor(k_lengths)[:, None] - 1
    return (torch.tensor(k_starts)[:, None] + torch.minimum(offsets, last)).flatten()


def decode_kv(cache: Any, layer_idx: int, key: torch.Tensor, value: torch.Tensor, k_starts: list[int],
              k_lengths: list[int], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Writes this step's keys and values ([1, kv_heads, requests, dim]) into the paged cache and returns every
    request's keys and values padded to the longest ([requests, kv_heads, longest, dim]; rows past a request's length
    are other slots of its page, to be masked), or None, with the cache untouched, when the fast path does not apply.
    `k_starts` and `k_lengths` are each request's place in the stock packed read-back, as the engine describes it."""
    allocator = _allocator(cache, layer_idx)
    if allocator is None or kwargs.get("block_table") is not None:
        return None
    try:
        read_index = kwargs["read_index"][allocator.index]
        write_index = kwargs["write_index"][allocator.index]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(read_index, torch.Tensor) or read_index.dim() != 1:
        return None
    if read_index.numel() < k_starts[-1] + k_lengths[-1] or write_index.numel() != len(k_starts):
        return None
    page = allocator.tokens_per_page
    pages = _pages(read_index, k_starts, k_lengths, page)
    k_cache, v_cache = allocator._kv_token_views[layer_idx]
    k_cache.index_copy_(0, write_index, key[0].transpose(0, 1))
    v_cache.index_copy_(0, write_index, value[0].transpose(0, 1))
    longest = max(k_lengths)
    if pages is None:  # a request spans pages: its token rows, padded with its last one
        rows = read_index[padded_positions(k_starts, k_lengths, longest).to(read_index.device)]
        n = len(k_starts)
        return tuple(cached.index_select(0, rows).view(n, longest, *cached.shape[1:]).transpose(1, 2)
                     for cached in (k_cache, v_cache))
    whole = k_cache.shape[0] // page * page
    padded = []
    for cached in (k_cache, v_cache):
        # [pages, kv_heads, longest, dim] as a view, so that the gather's output is contiguous in the layout SDPA
        # reads (measured: gather and SDPA both faster than over the transposed copy, with the same result)
        by_page = cached[:whole].view(-1, page, *cached.shape[1:])[:, :longest].permute(0, 2, 1, 3)
        padded.append(by_page.index_select(0, pages))
    return padded[0], padded[1]
