"""Batch-invariant attention: every query token attends in a call whose shape follows from its own position only, so
its result is the same whatever shares its step, and whether it is computed in a prompt chunk or as a decode step.

**What moved, measured** (2-core Intel Xeon, Sapphire Rapids; torch 2.13 CPU; benchmarks/batch_invariance.py). The
per-sequence path attends all decode tokens of a step in one SDPA call, each request's keys padded to the batch's
longest and masked: a request's result then follows the longest (bfloat16, 8 requests of 40 keys padded to 300:
other bits). Prompt chunks run as one causal call each, whose query count and key count follow where the token budget
cut the prompt: in float32 a row moves with the number of query rows (1 against 3 or more), and in bfloat16 with more
than 64 of them over 320 keys or more. A prompt's last token may even be computed as a single-token "decode" query in
one run and inside a chunk in another.

**How it is made invariant.** Every query token, prompt or decode, is one row group of SDPA: its query heads folded
onto their KV head (`[n, kv_heads, group, dim]`, as per-sequence decode does), over its own keys (its window's, in a
sliding-window layer) placed first and padded to the next multiple of `KEY_BUCKET`, with a key mask. So the call a
token's row sees depends only on the token's position. SDPA's CPU kernel computes each batch row on its own (one row
moves neither with the rows beside it, nor with the batch size, nor with the thread count: measured, 20 random
subsets of 64 rows at 64 to 1,024 keys, bfloat16 and float32), so the tokens of a step are grouped freely: decode
tokens of one bucket in one call, a chunk's tokens of one bucket in one call over their shared prefix (a stride-0
view, no copy). Padding slots repeat the request's last key (finite) and are masked, so they add exact zeros.

**Which thread computes a row** matters too, measured on a 2-core AMD EPYC (Zen 4: AVX-512 with BF16, no AMX) and
under AVX2 (torch, oneDNN and MKL held to AVX2 there): torch's CPU flash attention splits the (batch row, KV head)
items of a call among its threads, and each thread works in a scratch buffer of its own, laid out one after another,
`query rows x (keys + head_dim + 2)` floats each. With an odd number of query rows (SmolLM2's three query heads per
KV head, or one in a model without grouped queries) the second thread's buffer is not 64-byte aligned, and MKL's
sgemm then sums in another order: float32 rows differed from the same row computed alone in 28 of 60 random batches
(bfloat16 rarely: one logprob of 32 sequences in a whole job). A row's thread follows the number of rows in the call,
so its bits followed the batch. Query rows are therefore padded with zero queries to a multiple of `QUERY_ROWS`,
which keeps every thread's buffer 64-byte aligned (the pad is cut from the result): 0 rows moved in 150 random
shapes, float32 and bfloat16, natively and under AVX2 (benchmarks/batch_invariance.py, `tests/attention`).

The cost: a prompt's attention runs about four times as long as one causal call (512 tokens, 9.5 ms against 2.3 ms
per layer in bfloat16); decode attention costs what the padded call cost. Whole jobs: docs/performance.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbgen.attention.layout import StepLayout
from cbgen.attention.pass_memo import remembered

QUERY_ROWS = 8  # query rows of a call, padded to a multiple of this (see the module): 8 x 4 bytes x (keys + dim + 2)
KEY_BUCKET = 64  # keys are padded to a multiple of this: a token's call shape changes once every 64 positions


@dataclass
class _Call:
    """One SDPA call: these query tokens over these key rows (one set per token, or one set shared by all)."""

    q_rows: torch.Tensor  # [n] the tokens' rows in the query
    keys: torch.Tensor  # [u, bucket] rows of the key source (u == n, or 1 when shared)
    mask: torch.Tensor  # [n, 1, 1, bucket]
    shared: bool


def _calls(batch: StepLayout, index: torch.Tensor | None) -> list[_Call]:
    """The calls of a forward pass for one layer type: each query token's own keys, grouped by padded length and,
    within a length, by a prefix shared among tokens (a prompt chunk's). `index` maps the packed key layout (each
    request's keys, request by request) to rows of the key source; None: they are the rows."""
    groups: dict[int, dict[tuple[int, int], list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for q_start, q_length, k_start, k_length in zip(batch.q_starts, batch.q_lengths, batch.k_starts,
                                                    batch.k_lengths):
        for j in range(q_length):
            own = k_length - q_length + j  # the token's own key, among the request's keys
            first = 0 if batch.window is None else max(0, own - batch.window + 1)
            count = own - first + 1
            bucket = -(-count // KEY_BUCKET) * KEY_BUCKET
            groups[bucket][(k_start + first, k_start + k_length - 1)].append((q_start + j, count))
    calls = []
    span = torch.arange(max(groups))
    for bucket, by_prefix in groups.items():
        singles = [(prefix, units[0]) for prefix, units in by_prefix.items() if len(units) == 1]
        sets = [([prefix], units) for prefix, units in by_prefix.items() if len(units) > 1]
        if singles:
            sets.append(([prefix for prefix, _ in singles], [unit for _, unit in singles]))
        for prefixes, units in sets:
            starts = torch.tensor([start for start, _ in prefixes])[:, None]
            ends = torch.tensor([end for _, end in prefixes])[:, None]
            keys = torch.minimum(starts + span[None, :bucket], ends)  # padding repeats the last key
            if index is not None:
                keys = index[keys.to(index.device)]
            counts = torch.tensor([count for _, count in units])
            mask = (span[None, :bucket] < counts[:, None])[:, None, None, :]
            q_rows = torch.tensor([row for row, _ in units])
            calls.append(_Call(q_rows, keys, mask, len(prefixes) == 1 and len(units) > 1))
    return calls


def padded_query_rows(group: int, head_dim: int) -> int:
    """The query rows a call runs with for `group` query heads per KV head: a multiple of QUERY_ROWS, or of twice it
    where an odd head size would leave a thread's buffer 32 bytes off (see the module)."""
    step = QUERY_ROWS if head_dim % 2 == 0 else 2 * QUERY_ROWS
    return -(-group // step) * step


def attend_invariant(query: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, index: torch.Tensor | None,
                     batch: StepLayout, scaling: float | None, out: torch.Tensor) -> None:
    """Every query token of the batch over its own keys, in calls shaped by its position only (see the module).
    `query`: [1, heads, tokens, dim]; `k_rows`, `v_rows`: the key and value source, token-major ([rows, kv_heads,
    dim]); `index`: the packed key layout's rows in it (or None); `out`: [tokens, heads, dim]."""
    num_heads, num_kv_heads, head_dim = query.shape[1], k_rows.shape[1], query.shape[-1]
    group = num_heads // num_kv_heads
    rows = padded_query_rows(group, head_dim)
    calls = remembered(("invariant calls", id(batch), id(index)), lambda: _calls(batch, index))
    by_token = query[0].transpose(0, 1)  # [tokens, heads, dim]
    for call in calls:
        n, bucket = call.q_rows.shape[0], call.keys.shape[1]
        q_rows = call.q_rows.to(query.device)
        q = by_token.index_select(0, q_rows).view(n, num_kv_heads, group, head_dim)
        if rows != group:  # zero queries after the real ones (see the module); their results are dropped
            q = torch.cat([q, q.new_zeros(n, num_kv_heads, rows - group, head_dim)], dim=2)
        flat = call.keys.flatten().to(k_rows.device)
        k, v = (source.index_select(0, flat).view(-1, bucket, num_kv_heads, source.shape[-1]).transpose(1, 2)
                for source in (k_rows, v_rows))
        if call.shared:
            k, v = k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=call.mask.to(query.device), scale=scaling)
        out.index_copy_(0, q_rows, attended[:, :, :group].reshape(n, num_heads, -1))
