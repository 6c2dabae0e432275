"""cbgen's compiled decoder-layer operators (cbgen/kernels/decoder_ops.cpp) against the eager pieces of the fused
layer (cbgen.model.fused, themselves bitwise transformers'), over random shapes and values in float32 and bfloat16:
the rotary embedding and SiLU * up bitwise, RMSNorm (and the residual addition before it) to float rounding; and
every row's bits its own, whatever rows share the call and however many threads run it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.kernels import kernel
from cbgen.model.fused import rms_norm, rope
from tests.helpers import torch_threads


@pytest.fixture(scope="module")
def ops():
    built = kernel("decoder_ops")
    assert built.loaded, built.detail  # CI has a compiler: the operators must build there
    return torch.ops.cbgen_kernels


class Norm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.variance_epsilon = weight, eps


DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def values(shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), width=st.sampled_from([8, 24, 64, 96, 576, 1000]), dtype=DTYPES,
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_rms_norm_and_the_residual_addition(ops, rows, width, dtype, seed, scale):
    x, residual = values((rows, width), dtype, seed, scale), values((rows, width), dtype, seed + 1, scale)
    norm = Norm(values((width,), dtype, seed + 2), 1e-6)
    assert_norm_close(ops.rms_norm(x, norm.weight, norm.variance_epsilon), x, norm)
    summed = x.clone()
    normed = ops.add_rms_norm(summed, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(summed, x + residual)  # the in-place addition, rounded as eager rounds it
    assert_norm_close(normed, x + residual, norm)


def assert_norm_close(got: torch.Tensor, x: torch.Tensor, norm: Norm) -> None:
    """`got` is transformers' RMSNorm of `x` but for the mean square's float32 summation order. In float32 that is
    float rounding; in bfloat16 the normalised value is rounded before the weight's product, so a last-bit change of
    it can move that rounding by an ulp (of the value, then times the weight), and the product's own by one more:
    up to 2^-7 of |weight| |normalised| + 2^-7 of |result| (bfloat16's spacing is at most 2^-7 of a value)."""
    expected = rms_norm(x, norm)
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
        return
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    bound = 2**-7 * (norm.weight.float().abs() * h.abs() + expected.float().abs()) + 1e-6
    assert ((got.float() - expected.float()).abs() <= bound).all()


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 70), heads=st.integers(1, 6), extra=st.integers(0, 3),
       dim=st.sampled_from([16, 32, 64, 80, 128]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_the_rotary_embedding_is_bitwise_the_eager_one(ops, tokens, heads, extra, dim, dtype, seed):
    qkv = values((tokens, (heads + extra) * dim), dtype, seed)  # `extra` heads after them stay as they are (values)
    cos, sin = values((tokens, dim), dtype, seed + 1), values((tokens, dim), dtype, seed + 2)
    rotated = qkv.clone()
    ops.rope_(rotated, cos, sin, heads, dim)
    q = qkv[:, : heads * dim].view(1, tokens, heads, dim)
    expected = rope(q, cos.view(1, tokens, 1, dim), sin.view(1, tokens, 1, dim)).view(tokens, -1)
    assert torch.equal(rotated[:, : heads * dim], expected)
    assert torch.equal(rotated[:, heads * dim :], qkv[:, heads * dim :])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), intermediate=st.sampled_from([8, 40, 64, 128, 1536]), dtype=DTYPES,
       seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 20.0]))
def test_silu_times_up_is_bitwise_the_eager_one(ops, rows, intermediate, dtype, seed, scale):
    gate_up = values((rows, 2 * intermediate), dtype, seed, scale)
    gate, up = gate_up.split(intermediate, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up, intermediate), F.silu(gate) * up)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(2, 70), width=st.sampled_from([64, 576]), dtype=DTYPES, seed=st.integers(0, 2**16),
       data=st.data())
def test_a_rows_bits_are_its_own(ops, rows, width, dtype, seed, data):
    """A row alone, among others and on one or two threads: the same bits."""
    x = values((rows, width), dtype, seed)
    weight = values((width,), dtype, seed + 1)
    gate_up = values((rows, 2 * width), dtype, seed + 2)
    row = data.draw(st.integers(0, rows - 1))
    with torch_threads(2):
        together = (ops.rms_norm(x, weight, 1e-5), ops.silu_mul(gate_up, width))
    with torch_threads(1):
        alone = (ops.rms_norm(x[row : row + 1].clone(), weight, 1e-5),
                 ops.silu_mul(gate_up[row : row + 1].clone(), width))
    assert torch.equal(together[0][row : row + 1], alone[0])
    assert torch.equal(together[1][row : row + 1], alone[1])


def test_the_check_can_tell_an_rms_norm_apart(ops):
    """The tolerance above is not loose enough to pass anything: an RMSNorm with another epsilon fails it."""
    x = values((8, 576), torch.float32, 0, 1e-3)
    weight = values((576,), torch.float32, 1)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ops.rms_norm(x, weight, 1e-3), rms_norm(x, Norm(weight, 1e-6)), rtol=2e-6,
                                   atol=1e-6)


def test_bad_arguments_are_refused(ops):
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.rms_norm(torch.randn(4, 8).t(), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="even head dimension"):
        ops.rope_(torch.randn(2, 6), torch.randn(2, 3), torch.randn(2, 3), 2, 3)
    with pytest.raises(RuntimeError, match="gate then up"):
        ops.silu_mul(torch.randn(2, 7), 3)
