"""cbgen's packed attention (cbgen/kernels/packed_attention.cpp) against torch's SDPA run on each sequence alone, over
random packed batches (lengths from 1 token, heads and key-value heads, dims that are not a multiple of a vector,
queries, keys and values as strided views of one projection's output) in float32 and bfloat16; and a sequence's
output its own, whatever sequences share the batch and however many threads run it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.kernels import kernel
from tests.helpers import TWO_THREADS, property_examples, torch_threads


@pytest.fixture(scope="module")
def ops():
    built = kernel("packed_attention")
    assert built.loaded, built.detail  # CI has a compiler: the kernel must build there
    return torch.ops.cbgen_kernels


def batch(lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """q, k, v as views of one [tokens, heads + 2 kv_heads, dim] tensor (as a fused projection lays them out), and
    the offsets."""
    tokens = sum(lengths)
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=generator).to(dtype)
    q, k, v = fused[:, :heads], fused[:, heads : heads + kv_heads], fused[:, heads + kv_heads :]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, offsets


def reference(q, k, v, offsets, scale):
    """SDPA in float64 over each sequence alone (keys and values repeated for grouped heads)."""
    group = q.shape[1] // k.shape[1]
    out = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1).double() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], scale=scale)[0].transpose(0, 1))
    return torch.cat(out)


@settings(max_examples=property_examples(40), deadline=None)
@given(lengths=st.lists(st.integers(1, 140), min_size=1, max_size=12), heads=st.sampled_from([1, 2, 4, 6]),
       group=st.sampled_from([1, 2]), dim=st.sampled_from([8, 24, 32, 40, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_each_sequence_attends_to_its_own_tokens(ops, lengths, heads, group, dim, dtype, seed):
    kv_heads = heads // group if heads % group == 0 else heads
    q, k, v, offsets = batch(lengths, heads, kv_heads, dim, dtype, seed)
    scale = dim**-0.5
    got = ops.packed_attention(q, k, v, offsets, scale)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    expected = reference(q, k, v, offsets, scale)
    if dtype == torch.float32:  # float32 sums in another order: float rounding
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6)
    else:  # computed in float32 from bfloat16 inputs, the result rounded to bfloat16 once
        torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=2**-8)


@settings(max_examples=property_examples(25), deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=2, max_size=10), pick=st.integers(0, 9),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_a_sequence_output_is_its_own_bits(ops, lengths, pick, dtype, seed):
    """Alone, first, last or among others, on one thread or two: the same bits."""
    q, k, v, offsets = batch(lengths, 4, 2, 32, dtype, seed)
    i = pick % len(lengths)
    start, end = int(offsets[i]), int(offsets[i + 1])
    alone = ops.packed_attention(q[start:end], k[start:end], v[start:end], torch.tensor([0, end - start]), 0.2)
    for threads in (1, TWO_THREADS):
        with torch_threads(threads):
            together = ops.packed_attention(q, k, v, offsets, 0.2)
        assert torch.equal(together[start:end], alone)


def test_bad_offsets_are_refused(ops):
    q, k, v, _ = batch([3, 4], 2, 2, 8, torch.float32, 0)
    with pytest.raises(RuntimeError, match="cu_seqlens rise from 0"):
        ops.packed_attention(q, k, v, torch.tensor([0, 5, 6]), 1.0)
