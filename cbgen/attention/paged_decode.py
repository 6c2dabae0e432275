"""The decode fast path of per-sequence attention: read each request's keys and values straight from its cache page.

In a step where every request decodes one token, the stock cache update writes the new keys and values, then reads
back every key of every request token by token (one index per token: ~9,000 rows per layer at 64 sequences of
~140 tokens), and the per-sequence path gathered those rows a second time to pad each request to the longest. Here
the write is the same, and the read copies as little as it can; the keys and values attended are the same. Profiled
on a 2-core AVX2 CPU (benchmarks/profile_step.py), those gathers were a fifth of a decode step at 64 sequences.

In a full-attention layer where every request's keys lie in one page from the page's first slot (a request no
longer than a page: 256 tokens by default):
- when the requests' pages make a compact range (pages are handed out in order, so they mostly do), SDPA reads that
  range of the cache in place: no copy at all. Pages of the range that belong to no request of the batch become
  rows whose output is dropped. Rows run in the order of the blocks (the engine hands them out from the top, so
  mostly backwards), and SDPA's rounding moves in the last bit with a row's place in the batch (<= 3e-7 measured),
  as it does whenever the batch changes: greedy tokens stay those of the stock path (tests/attention);
- otherwise one gather of whole pages' rows.
When a request spans pages, one gather of token rows, already padded, through the stock read index: still one
gather, not two. Anything unexpected returns None, for the caller to take the stock update.

It reads private attributes of transformers' paged cache, which is why cbgen's attention installs only with the
transformers versions it was checked against (support.VALIDATED_TRANSFORMERS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cbgen.attention.pass_memo import remembered
from cbgen.attention.support import FULL_ATTENTION


def _allocator(cache: Any, layer_idx: int) -> Any:
    allocator = getattr(cache, "layer_to_allocator", {}).get(layer_idx)
    if allocator is None or getattr(allocator, "layer_type", None) != FULL_ATTENTION:
        return None
    views = getattr(allocator, "_kv_token_views", None)
    if not isinstance(views, dict) or layer_idx not in views or not isinstance(allocator.tokens_per_page, int):
        return None
    return allocator


# Attend over the whole range of the requests' pages, in place, while it holds at most this many pages per request:
# a page in the range that no request of the batch owns costs SDPA about what gathering a request's page costs
# (measured on a 2-core AVX2 CPU, 64 requests of 192 tokens: 3.6 ms per layer for SDPA, 3.5 ms for the gather)
_SPAN_PER_REQUEST = 1.5


@dataclass
class PageRead:
    """The keys and values a decode step attends ([rows, kv_heads, longest, dim]; slots past a request's length are
    other slots of its page, to be masked) and where each request's row is."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor | None  # request i's row in keys and values; None: row i
    kind: str  # "in place" (views of the pages' range), "pages" (a gather of whole pages' rows), "rows" (token rows)


def _pages(read_index: torch.Tensor, k_starts: list[int], k_lengths: list[int], page: int) -> torch.Tensor | None:
    """The page (in the layer's page view) holding each request's keys, on the CPU, or None when a request's keys do
    not fill one page from its first slot in order."""
    if max(k_lengths) > page:
        return None
    starts = torch.tensor(k_starts)
    lengths = torch.tensor(k_lengths)
    first = read_index[starts.to(read_index.device)].cpu()
    last = read_index[(starts + lengths - 1).to(read_index.device)].cpu()
    if bool(((first % page) != 0).any()) or not torch.equal(last - first, lengths - 1):
        return None
    return first // page


def _where(allocator: Any, read_index: torch.Tensor, k_starts: list[int], k_lengths: list[int]) -> tuple[Any, Any]:
    """(each request's page or None, the range of blocks to read in place or None): the same for every layer of the
    allocator in a forward pass."""
    pages = _pages(read_index, k_starts, k_lengths, allocator.tokens_per_page)
    return pages, None if pages is None else _span(allocator, pages, len(k_starts))


def _span(allocator: Any, pages: torch.Tensor, n: int) -> tuple[int, int, int, torch.Tensor | None] | None:
    """(first block, last block, pages per block, each request's row in the range or None when row i is request i)
    when the requests' pages make a compact range of blocks; else None.

    A block holds one page per layer for keys and one for values ([L0 keys | L0 values | L1 keys | ...]), so in a
    layer's view of the cache a block's page comes every `2 * layers` pages."""
    layers = getattr(allocator, "layer_indices", None)
    if not layers:
        return None
    stride = 2 * len(layers)
    if bool((pages % stride != 0).any()):
        return None
    blocks = pages // stride
    low, high = int(blocks.min()), int(blocks.max())
    if high - low + 1 > _SPAN_PER_REQUEST * n:
        return None
    in_order = high - low + 1 == n and torch.equal(blocks, torch.arange(low, low + n))
    return low, high, stride, None if in_order else blocks - low


def padded_positions(k_starts: list[int], k_lengths: list[int], longest: int) -> torch.Tensor:
    """Where each request's keys lie in the packed read-back, padded to `longest` by repeating its last one:
    [requests * longest], request by request."""
    offsets = torch.arange(longest)[None, :]
    last = torch.tensor(k_lengths)[:, None] - 1
    return (torch.tensor(k_starts)[:, None] + torch.minimum(offsets, last)).flatten()


def decode_kv(cache: Any, layer_idx: int, key: torch.Tensor, value: torch.Tensor, k_starts: list[int],
              k_lengths: list[int], kwargs: dict[str, Any]) -> PageRead | None:
    """Writes this step's keys and values ([1, kv_heads, requests, dim]) into the paged cache and returns what each
    request attends, or None, with the cache untouched, when the fast path does not apply. `k_starts` and `k_lengths`
    are each request's place in the stock packed read-back, as the engine describes it."""
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
    pages, span = remembered(("pages", id(allocator), id(read_index)),
                             lambda: _where(allocator, read_index, k_starts, k_lengths))
    k_cache, v_cache = allocator._kv_token_views[layer_idx]
    k_cache.index_copy_(0, write_index, key[0].transpose(0, 1))
    v_cache.index_copy_(0, write_index, value[0].transpose(0, 1))
    longest = max(k_lengths)
    if pages is None:  # a request spans pages: its token rows, padded with its last one
        rows = read_index[padded_positions(k_starts, k_lengths, longest).to(read_index.device)]
        n = len(k_starts)
        keys, values = (cached.index_select(0, rows).view(n, longest, *cached.shape[1:]).transpose(1, 2)
                        for cached in (k_cache, v_cache))
        return PageRead(keys, values, None, "rows")
    # [pages, kv_heads, longest, dim] as views of the layer's cache
    whole = k_cache.shape[0] // page * page
    by_page = [cached[:whole].view(-1, page, *cached.shape[1:])[:, :longest].permute(0, 2, 1, 3)
               for cached in (k_cache, v_cache)]
    if span is not None:
        # SDPA reads the range of blocks where their pages lie: no copy
        low, high, stride, rows = span
        return PageRead(*(view[low * stride : high * stride + 1 : stride] for view in by_page),
                        None if rows is None else rows.to(key.device), "in place")
    # else one gather of whole pages' rows, into the layout SDPA reads fastest
    pages = pages.to(key.device)
    return PageRead(by_page[0].index_select(0, pages), by_page[1].index_select(0, pages), None, "pages")
