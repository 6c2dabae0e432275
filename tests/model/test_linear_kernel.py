"""cbgen's compiled linear tiles (cbgen/kernels/linear_tiles.cpp, cbgen.model.tiles_kernel) as properties over random
shapes: float32 within rounding of torch's linear; a row's bits its own, whatever shares the call, where the row sits
and on one thread or two, checked with rows that show any change in a sum's order (with a control that changes only
that order, which the check catches); and where the kernel cannot serve, the fixed tiles run and planning says why.
In the slow suite the same properties run with ATen and oneDNN held to AVX2 and to AVX-512 BF16 without AMX (the
bfloat16 weights then take the kernel's own pair-interleaved packing, not ATen's AMX one)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbgen.model import tiles_kernel
from cbgen.model.invariant import batch_invariant_linear, probe_rows
from tests.helpers import NO_AMX, OTHER_ISAS, TWO_THREADS, property_examples, pytest_under_isa, torch_threads


def served() -> list[torch.dtype]:
    return [dtype for dtype in (torch.float32, torch.bfloat16) if tiles_kernel.unfit_reason(dtype) is None]


@pytest.fixture(scope="module")
def ops():
    from cbgen.kernels import kernel

    built = kernel(tiles_kernel.KERNEL)
    assert built.loaded, built.detail
    return torch.ops.cbgen_kernels


@st.composite
def layers(draw):
    dtype = draw(st.sampled_from(served() or [torch.float32]))
    in_features = draw(st.sampled_from([2, 24, 64, 576, 1536]) | st.integers(1, 700))
    if dtype == torch.bfloat16:
        in_features += in_features % 2  # bfloat16 weights pack in pairs of inputs
    count = draw(st.sampled_from([1, 63, 64, 65, 128, 600]) | st.integers(1, 300))
    return dict(dtype=dtype, in_features=in_features, count=count, place=draw(st.integers(0, count - 1)),
                out_features=draw(st.sampled_from([1, 16, 64, 65, 576, 1536]) | st.integers(1, 300)),
                bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                block_n=draw(st.sampled_from([tiles_kernel.BLOCK_N, tiles_kernel.BLOCK_N_AVX2_FLOAT32])))


def _layer(case):
    generator = torch.Generator().manual_seed(case["seed"])
    weight = (torch.randn(case["out_features"], case["in_features"], generator=generator) * 0.05).to(case["dtype"])
    bias = torch.randn(case["out_features"], generator=generator).to(case["dtype"]) if case["bias"] else None
    plain = torch.randn(case["count"], case["in_features"], generator=generator).to(case["dtype"])
    return weight, bias, probe_rows(weight, case["count"], generator), plain


@settings(max_examples=property_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
def test_the_kernel_computes_the_linear_layer_and_a_row_gets_its_own_bits(ops, case):
    if not served():
        pytest.skip(f"the kernel serves no dtype here: {tiles_kernel.unfit_reason(torch.float32)}")
    weight, bias, rows, plain = _layer(case)
    packed = ops.linear_pack(weight, case["block_n"])  # both widths, whichever this machine's layers use
    out_features, place = weight.shape[0], case["place"]
    # the bits: rows whose sums show any change of order (probe_rows), on two threads, alone, and first of a call
    with torch_threads(TWO_THREADS):
        together = ops.linear_tiles(rows, packed, bias, out_features)
    alone = ops.linear_tiles(rows[place : place + 1], packed, bias, out_features)[0]
    assert torch.equal(together[place], alone)
    assert torch.equal(ops.linear_tiles(rows[place:], packed, bias, out_features)[0], alone)
    # the values: within the rounding error of a float32 sum of K products (K * 2^-24 of the sum of their sizes),
    # rounded once to the dtype
    result = ops.linear_tiles(plain, packed, bias, out_features).double()
    exact = torch.nn.functional.linear(plain.double(), weight.double(), None if bias is None else bias.double())
    sizes = plain.double().abs() @ weight.double().abs().t() + (0 if bias is None else bias.double().abs())
    rounding = 0.0 if case["dtype"] == torch.float32 else 2**-8
    assert ((result - exact).abs() <= exact.abs() * rounding + sizes * (case["in_features"] + 1) * 2**-24).all()
    if case["dtype"] == torch.float32:
        torch.testing.assert_close(result, torch.nn.functional.linear(plain, weight, bias).double(), rtol=1e-5,
                                   atol=1e-5)


# linear_tiles.cpp's DECODE_MIN_ROWS..DECODE_MAX_ROWS: float32 calls of these many rows over 32-column panels run its
# own decode-step kernel where it is built with AVX2; every other row count runs brgemm
DECODE_ROWS = (12, 24)


@settings(max_examples=property_examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(count=st.integers(*DECODE_ROWS), in_features=st.sampled_from([64, 512, 576, 1536, 2048]) | st.integers(1, 1100),
       out_features=st.sampled_from([1, 32, 96, 100]) | st.integers(1, 200), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_decode_sized_call_gives_each_row_the_bits_brgemm_gives_it(ops, count, in_features, out_features, bias, seed):
    """The decode-step kernel and brgemm sum in the same order: a 12-24 row call equals the same call through brgemm,
    and each of its rows the row alone (one row: brgemm) and the row among 64 (brgemm), on rows that show any change
    in a sum's order, with chunks of 512 inputs and their 64-input passes cut anywhere (in_features up to 1,100)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias_t = torch.randn(out_features, generator=generator) if bias else None
    packed = ops.linear_pack(weight, tiles_kernel.BLOCK_N_AVX2_FLOAT32)
    rows = probe_rows(weight, 64, generator)
    with torch_threads(TWO_THREADS):
        decode = ops.linear_tiles(rows[:count], packed, bias_t, out_features)
        among = ops.linear_tiles(rows, packed, bias_t, out_features)
    assert torch.equal(decode, ops.linear_tiles_brgemm(rows[:count], packed, bias_t, out_features))
    assert torch.equal(decode, among[:count])
    for i in (0, count // 2, count - 1):
        assert torch.equal(decode[i], ops.linear_tiles(rows[i : i + 1], packed, bias_t, out_features)[0])
    plain = torch.randn(count, in_features, generator=generator)  # the values: within rounding of torch's linear
    torch.testing.assert_close(ops.linear_tiles(plain, packed, bias_t, out_features),
                               torch.nn.functional.linear(plain, weight, bias_t), rtol=1e-5, atol=1e-5)


def test_the_check_catches_a_sum_in_another_order(ops):
    """The control: a linear that is the kernel's for a row alone but adds a row's even and odd inputs apart when the
    call has more rows (only the order of the sum changes). The probe rows show it in bfloat16, where rounding hides
    most such changes from random rows."""
    dtype = torch.bfloat16 if torch.bfloat16 in served() else torch.float32
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(576, 576, generator=generator) * 0.05).to(dtype)
    rows = probe_rows(weight, 96, generator)
    width = tiles_kernel.block_n(dtype)
    packed = ops.linear_pack(weight, width)
    halves = [ops.linear_pack(weight[:, part].contiguous(), width) for part in (slice(0, None, 2), slice(1, None, 2))]

    def other_order(x):
        if x.shape[0] == 1:
            return ops.linear_tiles(x, packed, None, 576)
        sums = [ops.linear_tiles(x[:, part].contiguous(), half, None, 576).float()
                for part, half in zip((slice(0, None, 2), slice(1, None, 2)), halves, strict=True)]
        return (sums[0] + sums[1]).to(dtype)

    def moved(linear) -> int:
        together = linear(rows)
        return sum(not torch.equal(together[i], linear(rows[i : i + 1])[0]) for i in range(rows.shape[0]))

    assert moved(lambda x: ops.linear_tiles(x, packed, None, 576)) == 0
    assert moved(other_order) > rows.shape[0] // 4


def test_a_models_layers_run_through_the_kernel_inside_the_block(ops):
    """batch_invariant_linear with the kernel: each nn.Linear through it (its bits a row's own), put back on exit."""
    dtype = served()[-1] if served() else torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)).to(dtype)
    rows = torch.randn(70, 64).to(dtype)
    with torch.no_grad():
        stock = model(rows)
        with batch_invariant_linear(model, kernel=ops if served() else None):
            assert all("forward" in vars(layer) for layer in model)
            tiled = model(rows)
            assert torch.equal(tiled[5], model(rows[5:6])[0])
        assert not any("forward" in vars(layer) for layer in model)
    tolerance = {"atol": 0.1, "rtol": 0.02} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(tiled, stock, **tolerance)


@pytest.mark.parametrize(("capability", "dtype", "width"), [("AVX2", torch.float32, 32), ("AVX512", torch.float32, 64),
                                                           ("AVX512", torch.bfloat16, 64)])
def test_a_layer_is_packed_in_the_panel_width_its_machine_runs_fastest(ops, monkeypatch, capability, dtype, width):
    """32-column panels for float32 under AVX2 kernels, 64 elsewhere: the width decided once (block_n), and the one a
    model's layer is packed in; the layer's output the same rows as torch's linear at either width."""
    from cbgen.model import packs

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert tiles_kernel.block_n(dtype) == width
    layer = torch.nn.Linear(96, 100).to(torch.float32)
    packs.clear()
    forward = tiles_kernel.tiled_forward(ops, layer)
    assert forward.args[2].shape == (-(-100 // tiles_kernel.block_n(torch.float32)), 96,
                                     tiles_kernel.block_n(torch.float32))
    rows = torch.randn(5, 96)
    with torch.no_grad():
        torch.testing.assert_close(forward(rows), layer(rows), atol=1e-5, rtol=1e-5)
    packs.clear()


def test_where_it_cannot_serve_the_reason_is_given(monkeypatch):
    assert "float16" in (tiles_kernel.unfit_reason(torch.float16) or "")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX")
    assert "AVX2" in (tiles_kernel.unfit_reason(torch.float32) or "")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "bfloat16 units" in (tiles_kernel.unfit_reason(torch.bfloat16) or "")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert "oneDNN" in (tiles_kernel.unfit_reason(torch.float32) or "")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "avx512-bf16-no-amx"])
def test_the_properties_hold_on_other_instruction_sets(isa, monkeypatch):
    if isa not in OTHER_ISAS:
        monkeypatch.setitem(OTHER_ISAS, isa, NO_AMX)
    pytest_under_isa(isa, __file__, "the_kernel_computes or the_check_catches", examples=25)
