"""Batch-invariant linear layers (cbgen.model.invariant) as a property: for any row count, a row's place among them,
layer shape, bias, dtype and thread count, a row's result through the fixed-shape tiles (the larger tiles included,
where this machine's probe plans them) is bitwise the row's result alone, and within rounding of the stock layer.
In the slow suite the same property runs with torch, oneDNN and MKL held to other CPU kinds' instructions
(tests.helpers.OTHER_ISAS)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cbgen.model.invariant as invariant
from cbgen.config.cpu import cpu_row
from cbgen.model.invariant import TILE_ROWS, fixed_shape_linear, pack, tile_plan, tile_sizes
from cbgen.process.runtime import RUNTIME
from tests.helpers import OTHER_ISAS, TWO_THREADS, property_examples, pytest_under_isa, torch_threads

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@st.composite
def layers(draw):
    count = draw(st.sampled_from([1, 2, TILE_ROWS - 1, TILE_ROWS, TILE_ROWS + 1, 256, 257, 640]) | st.integers(1, 600))
    return dict(dtype=draw(st.sampled_from(sorted(DTYPES))),
                out_features=draw(st.sampled_from([16, 192, 576, 1536, 6144])),
                in_features=draw(st.sampled_from([24, 64, 576, 1536])), bias=draw(st.booleans()), count=count,
                place=draw(st.integers(0, count - 1)), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=property_examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
def test_a_row_gets_the_same_bits_in_any_batch(case):
    with torch_threads(TWO_THREADS):  # the batch on two threads, the row again on one
        _same_bits_on_two_threads(case)


def _same_bits_on_two_threads(case) -> None:
    dtype = DTYPES[case["dtype"]]
    generator = torch.Generator().manual_seed(case["seed"])
    weight = torch.randn(case["out_features"], case["in_features"], generator=generator).to(dtype)
    bias = torch.randn(case["out_features"], generator=generator).to(dtype) if case["bias"] else None
    rows = torch.randn(case["count"], case["in_features"], generator=generator).to(dtype)
    packed = pack(weight)
    # float32 tiles run over prepacked weights wherever torch has oneDNN; bfloat16 ones on CPUs with bf16 units
    packs = dtype == torch.float32 or cpu_row().dtype == "bfloat16"
    assert (packed is None) == (not packs or not torch.backends.mkldnn.is_available())
    place = case["place"]
    sizes = tile_sizes(weight, packed)  # as the engine plans the layer on this machine
    together = fixed_shape_linear(rows, weight, bias, packed, sizes)
    alone = fixed_shape_linear(rows[place : place + 1], weight, bias, packed, sizes)[0]
    assert torch.equal(together[place], alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fixed_shape_linear(rows, weight, bias, packed, sizes)[place], alone)
    finally:
        torch.set_num_threads(threads)
    tolerance = {"atol": 0.5, "rtol": 0.02} if dtype == torch.bfloat16 else {"atol": 1e-3, "rtol": 1e-4}
    torch.testing.assert_close(together, torch.nn.functional.linear(rows, weight, bias), **tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(OTHER_ISAS))
def test_the_property_holds_on_other_instruction_sets(isa):
    pytest_under_isa(isa, __file__, "test_a_row_gets_the_same_bits_in_any_batch")


def test_other_tile_sizes_are_planned_only_where_bitwise_the_64_row_ones(monkeypatch):
    """The probe's control: where another size's rows differ from the 64-row tiles' (here made to, by a kernel that
    rounds every other call size's results differently), it plans none; with the real kernel, the sizes it finds give
    the 64-row tiles' bits in a call whose plan uses them."""
    dtype = torch.bfloat16 if cpu_row().dtype == "bfloat16" else torch.float32  # the dtypes whose tiles are packed
    weight = torch.randn(192, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    packed = pack(weight)
    assert packed is not None
    real = invariant._onednn_tile

    def rounds_other_sizes_differently(source, packed_weight):
        result = real(source, packed_weight)
        return result + 1 if source.shape[0] != TILE_ROWS else result

    monkeypatch.setattr(invariant, "_probed_before", dict)  # no answer kept on disk: it probes, and keeps nothing
    monkeypatch.setattr(invariant, "_remember", lambda name, sizes: None)
    RUNTIME.clear("linear tile sizes")
    monkeypatch.setattr(invariant, "_onednn_tile", rounds_other_sizes_differently)
    assert tile_sizes(weight, packed) == ()
    RUNTIME.clear("linear tile sizes")
    monkeypatch.setattr(invariant, "_onednn_tile", real)
    sizes = tile_sizes(weight, packed)
    assert sizes, "no other tile size is bitwise the 64-row one for this shape here (the plan would only use 64)"
    rows = torch.randn(600, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert any(size != TILE_ROWS for _, size in tile_plan(600, sizes, invariant.CALL_ROWS[dtype]))
    planned = fixed_shape_linear(rows, weight, None, packed, sizes)
    assert torch.equal(planned, fixed_shape_linear(rows, weight, None, packed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probe_tells_apart_a_kernel_that_only_adds_in_another_order(monkeypatch, dtype):
    """The probe's harder control: tiles whose arithmetic is the 64-row tile's but for the order of a row's sum (the
    even products, then the odd ones, then the two added), the one difference a kernel chosen by shape makes. Random
    rows nearly hide it in bfloat16 (the sums differ by an ulp of float32, which bfloat16's rounding hides in most
    outputs: 24 of 147,456 differed here); the probe's rows, whose large cancelling pair leaves one output's sum near 1
    after partial sums of 2^16, do not (391)."""
    weight = (torch.randn(576, 576, generator=torch.Generator().manual_seed(4)) * 0.02).to(dtype)

    w = weight.float()

    def one_sum(source, packed_weight):  # row by row, so that no tile size changes a row's arithmetic
        return torch.cat([row.float() @ w.t() for row in source.split(1)]).to(dtype)

    def even_then_odd(source, packed_weight):
        if source.shape[0] == TILE_ROWS:
            return one_sum(source, packed_weight)
        return torch.cat([row.float()[:, 0::2] @ w[:, 0::2].t() + row.float()[:, 1::2] @ w[:, 1::2].t()
                          for row in source.split(1)]).to(dtype)

    monkeypatch.setattr(invariant, "_onednn_tile", even_then_odd)

    def differing(rows):
        return int((invariant._in_tiles(rows, weight, 128) != invariant._in_tiles(rows, weight, TILE_ROWS)).sum())

    probe = differing(invariant.probe_rows(weight, 256, torch.Generator().manual_seed(0)))
    plain = differing(torch.randn(256, 576, generator=torch.Generator().manual_seed(0)).to(dtype))
    if dtype == torch.bfloat16:  # the probe's rows show the other order many times more often (379 against 21 here)
        assert probe >= 5 * max(plain, 1)
    else:  # float32 rounding hides nothing: plain rows show it in most outputs, and so do the probe's
        assert probe > weight.numel() // 10 and plain > weight.numel() // 10
    assert invariant._probe_tile_sizes(weight, weight) == ()
    monkeypatch.setattr(invariant, "_onednn_tile", one_sum)  # the same order in every tile: every size is bitwise
    assert invariant._probe_tile_sizes(weight, weight) == invariant.TILE_SIZES


def test_a_warm_start_reads_the_probes_answer(monkeypatch, tmp_path):
    """The answer is kept in the kernels cache under what it depends on: the next process reads it and probes
    nothing; another thread count (or machine, torch, oneDNN setting) is another name, and is probed."""
    monkeypatch.setenv("CBGEN_KERNEL_CACHE_DIR", str(tmp_path / "kernels"))
    dtype = torch.bfloat16 if cpu_row().dtype == "bfloat16" else torch.float32
    weight = torch.randn(192, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    packed = pack(weight)
    RUNTIME.clear("linear tile sizes")
    RUNTIME.clear("linear tile probes read")
    probed = tile_sizes(weight, packed)
    kept = json.loads((tmp_path / "kernels" / invariant.PROBES_FILE).read_text())
    assert list(kept.values()) == [list(probed)]

    def no_probe(*args):
        raise AssertionError("probed again")

    monkeypatch.setattr(invariant, "_probe_tile_sizes", no_probe)
    RUNTIME.clear("linear tile sizes")  # a fresh process
    RUNTIME.clear("linear tile probes read")
    assert tile_sizes(weight, packed) == probed
    RUNTIME.clear("linear tile sizes")
    with torch_threads(torch.get_num_threads() + 1), pytest.raises(AssertionError, match="probed again"):
        tile_sizes(weight, packed)
    RUNTIME.clear("linear tile probes read")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.sets(st.sampled_from(invariant.TILE_SIZES)), st.sampled_from([0, 16, 96, 1000]))
def test_a_plan_covers_the_rows_once_in_its_sizes(count, sizes, call_rows):
    plan = tile_plan(count, tuple(sorted(sizes)), call_rows)
    assert plan[0][0] == 0 and all(size in {TILE_ROWS, *sizes} for _, size in plan)
    assert all(start + size == following for (start, size), (following, _) in zip(plan, plan[1:], strict=False))
    last_start, last_size = plan[-1]
    assert last_start < count <= last_start + last_size  # only the last tile runs past the rows, and not by a tile
