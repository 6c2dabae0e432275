"""Per-sequence attention's reads of the paged cache: each request's keys and values from where they lie.

The stock cache update writes a step's new keys and values, then reads back every key of every request token by
token (one index per token: ~9,000 rows per layer at 64 sequences of ~140 tokens), packed, and the per-sequence path
gathered the single-token requests' rows a second time to pad each to the longest. Here the write is the same
(`LayerCache.write`) and the reads copy as little as they can; the keys and values attended are the same. Profiled on
a 2-core AVX2 CPU (benchmarks/profile_step.py), those gathers were a fifth of a decode step at 64 sequences. In the
steps of cbgen bench's mixed workload that mix prompt chunks with decoding requests, the read-back and the decoding
requests' attention took 27 % of the step (10.9 of 39.8 s), and 13 % (4.5 of 35.5 s) once read this way.

Single-token requests (`read_requests`), in a full-attention layer where every one's keys lie in one page from the
page's first slot (a request no longer than a page: 256 tokens by default):
- when their pages make a compact range (pages are handed out in order, so they mostly do), SDPA reads that range of
  the cache in place: no copy at all. Pages of the range that belong to no request of the batch become rows whose
  output is dropped. Rows run in the order of the blocks (the engine hands them out from the top, so mostly
  backwards), and SDPA's rounding moves in the last bit with a row's place in the batch (<= 3e-7 measured), as it
  does whenever the batch changes: greedy tokens stay those of the stock path (tests/attention);
- otherwise one gather of whole pages' rows.
When a request spans pages, one gather of token rows, already padded, through the stock read index: still one
gather, not two. A prompt chunk (`LayerCache.read_chunk`) attends its own new keys when it has no past, else one
gather of its rows. Anything unexpected (`layer_cache` returns None) leaves the layer to the stock update.

It reads private attributes of transformers' paged cache, which is why cbgen's attention installs only with the
transformers versions it was checked against (support.VALIDATED_TRANSFORMERS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cbgen.attention.pass_memo import remembered
from cbgen.attention.support import FULL_ATTENTION

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )


def _allocator(cache: Any, layer_idx: int) -> FullAttentionCacheAllocator | None:
    allocator = getattr(cache, "layer_to_allocator", {}).get(layer_idx)
    if allocator is None or getattr(allocator, "layer_type", None) != FULL_ATTENTION:
        return None
    views = getattr(allocator, "_kv_token_views", None)
    if not isinstance(views, dict) or layer_idx not in views or not isinstance(allocator.tokens_per_page, int):
        return None
    return allocator


# Attend over the whole range of the requests' pages, in place, while it holds at most this many pages per request:
# a page in the range that no request of the batch owns costs SDPA about what gathering a request's page costs
# (figures: docs/performance.md, 'Why the constants are what they are')
_SPAN_PER_REQUEST = 1.5


@dataclass
class PageRead:
    """The keys and values a decode step attends ([rows, kv_heads, longest, dim]; slots past a request's length are
    other slots of its page, to be masked) and where each request's row is."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor | None  # request i's row in keys and values; None: row i
    # "in place" (views of the pages' range), "pages" (a gather of whole pages' rows), "rows" (token rows), "packed"
    # (gathered from the stock update's packed read-back, by per_sequence)
    kind: str


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


@dataclass
class LayerCache:
    """A full-attention layer's views of the paged cache and this step's read and write indices."""

    allocator: FullAttentionCacheAllocator
    read_index: torch.Tensor  # the stock packed read-back: each request's past then new tokens, request by request
    write_index: torch.Tensor  # where each new token goes
    k_cache: torch.Tensor  # [slots, kv_heads, dim]
    v_cache: torch.Tensor

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Writes this step's keys and values ([1, kv_heads, tokens, dim]) as the stock update does."""
        self.k_cache.index_copy_(0, self.write_index, key[0].transpose(0, 1))
        self.v_cache.index_copy_(0, self.write_index, value[0].transpose(0, 1))

    def read_chunk(self, key: torch.Tensor, value: torch.Tensor, q_start: int, q_length: int, k_start: int,
                   k_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's keys and values ([1, kv_heads, k_length, dim]): the new ones themselves when it has no past
        (what the read-back would return, since they were just written), else its rows of the cache."""
        if k_length == q_length:
            span = slice(q_start, q_start + q_length)
            return key[:, :, span], value[:, :, span]
        rows = self.read_index[k_start : k_start + k_length]
        return (self.k_cache.index_select(0, rows).transpose(0, 1).unsqueeze(0),
                self.v_cache.index_select(0, rows).transpose(0, 1).unsqueeze(0))


def layer_cache(cache: Any, layer_idx: int, kwargs: dict[str, Any], k_end: int, new_tokens: int) -> LayerCache | None:
    """The layer's cache views when it is a full-attention layer of the index-based cache whose read-back covers
    `k_end` rows and whose write index has one slot per new token; else None (the caller takes the stock update)."""
    allocator = _allocator(cache, layer_idx)
    if allocator is None or kwargs.get("block_table") is not None:
        return None
    try:
        read_index = kwargs["read_index"][allocator.index]
        write_index = kwargs["write_index"][allocator.index]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(read_index, torch.Tensor) or read_index.dim() != 1 or not isinstance(write_index, torch.Tensor):
        return None
    if read_index.numel() < k_end or write_index.numel() != new_tokens:
        return None
    return LayerCache(allocator, read_index, write_index, *allocator._kv_token_views[layer_idx])


def read_requests(layer: LayerCache, k_starts: list[int], k_lengths: list[int], device: torch.device) -> PageRead:
    """What the given single-token requests attend (their keys already written), read from their cache pages."""
    allocator, read_index = layer.allocator, layer.read_index
    page = allocator.tokens_per_page
    pages, span = remembered(("pages", id(allocator), id(read_index), k_starts[0], len(k_starts)),
                             lambda: _where(allocator, read_index, k_starts, k_lengths))
    longest = max(k_lengths)
    if pages is None:  # a request spans pages: its token rows, padded with its last one
        rows = read_index[padded_positions(k_starts, k_lengths, longest).to(read_index.device)]
        n = len(k_starts)
        keys, values = (cached.index_select(0, rows).view(n, longest, *cached.shape[1:]).transpose(1, 2)
                        for cached in (layer.k_cache, layer.v_cache))
        return PageRead(keys, values, None, "rows")
    # [pages, kv_heads, longest, dim] as views of the layer's cache
    whole = layer.k_cache.shape[0] // page * page
    by_page = [cached[:whole].view(-1, page, *cached.shape[1:])[:, :longest].permute(0, 2, 1, 3)
               for cached in (layer.k_cache, layer.v_cache)]
    if span is not None:
        # SDPA reads the range of blocks where their pages lie: no copy
        low, high, stride, rows = span
        keys, values = (view[low * stride : high * stride + 1 : stride] for view in by_page)
        return PageRead(keys, values, None if rows is None else rows.to(device), "in place")
    # else one gather of whole pages' rows, into the layout SDPA reads fastest
    pages = pages.to(device)
    return PageRead(by_page[0].index_select(0, pages), by_page[1].index_select(0, pages), None, "pages")
