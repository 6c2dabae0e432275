"""A continuous-batching step laid out as transformers' paged cache lays it out, for the compiled attention's tests:
each request's cached keys in the slots of its pages (pages in a shuffled order, as a cache hands them out), its new
keys and values in the step's tensors, and the engine's read and write indices."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Step:
    query: torch.Tensor  # [1, heads, tokens, dim] (a transposed view, as the models pass it)
    key: torch.Tensor  # [1, kv_heads, tokens, dim]
    value: torch.Tensor
    k_cache: torch.Tensor  # [slots, kv_heads, dim]
    v_cache: torch.Tensor
    read_index: torch.Tensor
    write_index: torch.Tensor
    requests: torch.Tensor  # [n, 5]: q_start, q_length, k_start, k_length, first_position
    window: int

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    def attend(self, write: bool = True) -> torch.Tensor:
        """The kernel's output for every token, [tokens, heads, dim]; `write`: the new keys go into the cache."""
        out = self.query.new_empty(self.query.shape[2], self.query.shape[1], self.query.shape[3])
        write_index = self.write_index if write else self.write_index[:0]
        torch.ops.cbgen_kernels.paged_attention(out, self.query, self.key, self.value, self.k_cache, self.v_cache,
                                                self.read_index, write_index, self.requests, self.window, self.scale)
        return out


def layout(requests: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
           window: int = 0, page: int = 16, seed: int = 0, tensors: dict | None = None) -> Step:
    """A step of `requests` ((tokens already cached, new tokens) each). In a sliding-window layer only the last
    window - 1 cached tokens are kept, as transformers' sliding cache keeps them. `tensors`: a request's own data
    from an earlier layout ({"q", "k", "v", "past_k", "past_v"} by request index), so that the same tokens can be
    laid out beside other requests."""
    g = torch.Generator().manual_seed(seed)
    kept = [past if not window else min(past, window - 1) for past, _ in requests]
    slots_needed = sum(kept) + sum(q for _, q in requests)
    pages = -(-slots_needed // page) + len(requests) + 2
    order = torch.randperm(pages, generator=g)
    slot_of_page = (order[:, None] * page + torch.arange(page)[None, :]).flatten()
    k_cache = torch.randn(pages * page, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=g).to(dtype)
    queries, keys, values, reads, writes, table = [], [], [], [], [], []
    used = q_start = k_start = 0
    for n, ((past, q_length), cached) in enumerate(zip(requests, kept)):
        # each request starts on a page of its own, as the cache's blocks are per request
        used = -(-used // page) * page
        past_slots = slot_of_page[used : used + cached]
        new_slots = slot_of_page[used + cached : used + cached + q_length]
        used += cached + q_length
        own = (tensors or {}).get(n)
        if own is None:
            own = {"q": torch.randn(q_length, heads, dim, generator=g).to(dtype),
                   "k": torch.randn(q_length, kv_heads, dim, generator=g).to(dtype),
                   "v": torch.randn(q_length, kv_heads, dim, generator=g).to(dtype),
                   "past_k": torch.randn(cached, kv_heads, dim, generator=g).to(dtype),
                   "past_v": torch.randn(cached, kv_heads, dim, generator=g).to(dtype)}
        k_cache[past_slots], v_cache[past_slots] = own["past_k"], own["past_v"]
        queries.append(own["q"])
        keys.append(own["k"])
        values.append(own["v"])
        reads += [past_slots, new_slots]
        writes.append(new_slots)
        table.append([q_start, q_length, k_start, cached + q_length, past - cached])
        q_start += q_length
        k_start += cached + q_length
    as_step = lambda parts: torch.cat(parts).unsqueeze(0).transpose(1, 2)  # noqa: E731 - [1, heads, tokens, dim]
    return Step(as_step(queries), as_step(keys), as_step(values), k_cache, v_cache, torch.cat(reads),
                torch.cat(writes), torch.tensor(table, dtype=torch.int64), window)


def own_tensors(step: Step, n: int) -> dict:
    """Request n's data in `step`, for `layout(..., tensors=)`."""
    q_start, q_length, k_start, k_length, _ = step.requests[n].tolist()
    cached = k_length - q_length
    past = step.read_index[k_start : k_start + cached]
    span = slice(q_start, q_start + q_length)
    return {"q": step.query[0, :, span].transpose(0, 1), "k": step.key[0, :, span].transpose(0, 1),
            "v": step.value[0, :, span].transpose(0, 1), "past_k": step.k_cache[past], "past_v": step.v_cache[past]}


def stock_attention(step: Step) -> torch.Tensor:
    """Each request through torch's scaled_dot_product_attention over its own keys in float32, with its causal (and
    sliding-window) mask: what transformers' sdpa attention computes for it. [tokens, heads, dim]."""
    out = torch.zeros(step.query.shape[2], step.query.shape[1], step.query.shape[3])
    for q_start, q_length, k_start, k_length, _ in step.requests.tolist():
        cached = k_length - q_length
        past = step.read_index[k_start : k_start + cached]
        span = slice(q_start, q_start + q_length)
        keys = torch.cat([step.k_cache[past].transpose(0, 1), step.key[0, :, span]], dim=1).float()
        values = torch.cat([step.v_cache[past].transpose(0, 1), step.value[0, :, span]], dim=1).float()
        own = torch.arange(q_length)[:, None] + cached
        columns = torch.arange(k_length)[None, :]
        keep = columns <= own
        if step.window:
            keep &= columns > own - step.window
        attended = F.scaled_dot_product_attention(step.query[:, :, span].float(), keys[None], values[None],
                                                  attn_mask=keep, scale=step.scale, enable_gqa=True)
        out[span] = attended[0].transpose(0, 1)
    return out
