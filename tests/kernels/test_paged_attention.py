"""cbgen's compiled paged attention (cbgen/kernels/paged_attention.cpp): what it computes, against torch's own
attention in float32 over random steps, and that it is batch-invariant by construction: a row's bits do not move
when other requests share the call, when its prompt is chunked otherwise, or with the thread count."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.kernels import kernel
from tests.helpers import property_examples, pytest_under_isa
from tests.kernels.paged_case import layout, own_tensors, stock_attention


@pytest.fixture(scope="module", autouse=True)
def built():
    state = kernel("paged_attention")
    assert state.loaded, state.detail  # CI has g++: the kernel must build there
    held = os.environ.get("ATEN_CPU_CAPABILITY")  # pytest_under_isa: built for that capability, in its own folder
    if held:
        assert state.library is not None and state.library.parent.name.startswith(f"paged_attention-{held}-")


heads_and_groups = st.tuples(st.integers(1, 3), st.sampled_from([1, 2, 3, 4]))  # (kv_heads, query heads per kv head)
requests = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=6)
windows = st.one_of(st.just(0), st.integers(2, 64))


@settings(max_examples=property_examples(40), deadline=None)
@given(requests=requests, shape=heads_and_groups, dim=st.sampled_from([16, 32, 64, 128]), window=windows,
       page=st.sampled_from([16, 64, 256]), seed=st.integers(0, 2**16))
def test_kernel_computes_what_torch_attention_computes_in_float32(requests, shape, dim, window, page, seed):
    kv_heads, group = shape
    step = layout(requests, kv_heads * group, kv_heads, dim, torch.float32, window, page, seed)
    expected = stock_attention(step)
    got = step.attend()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    # and the step's new keys and values were written where the engine's write index says
    assert torch.equal(step.k_cache[step.write_index], step.key[0].transpose(0, 1))
    assert torch.equal(step.v_cache[step.write_index], step.value[0].transpose(0, 1))


def test_bfloat16_rows_are_float32_rows_rounded_once():
    step = layout([(0, 9), (57, 1), (130, 4)], 9, 3, 64, torch.bfloat16, seed=3)
    expected = stock_attention(step)
    # the kernel works in float32 throughout and rounds each output once: within one bfloat16 step of the truth
    torch.testing.assert_close(step.attend().float(), expected, atol=8e-3, rtol=8e-3)


def test_padding_tokens_and_an_empty_read_index():
    # a step with no cached keys at all (the engine leaves the read index empty) and tokens after the last request
    step = layout([(0, 5), (0, 3)], 4, 2, 16, torch.float32, seed=1)
    step.read_index = step.read_index[:0]
    expected = stock_attention(step)
    torch.testing.assert_close(step.attend()[:8], expected, atol=2e-5, rtol=1e-5)


def _rows_alone_and_beside(dtype, target, others, chunks, window, threads, seed):
    """The target request's rows computed alone in one call, and again beside other requests, its new tokens split
    into `chunks` successive calls (each writing its keys to the cache, as the engine's steps do) on `threads`."""
    kv_heads, group, dim = 2, 3, 32
    alone = layout([target], kv_heads * group, kv_heads, dim, dtype, window, seed=seed)
    mine = own_tensors(alone, 0)
    reference = alone.attend()
    past, q_length = target
    rows, done = [], 0
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for size in chunks:
            size = min(size, q_length - done)
            if size <= 0:
                break
            # this chunk's own tokens: its queries, and as cached past everything before it
            piece = {"q": mine["q"][done : done + size], "k": mine["k"][done : done + size],
                     "v": mine["v"][done : done + size],
                     "past_k": torch.cat([mine["past_k"], mine["k"][:done]]),
                     "past_v": torch.cat([mine["past_v"], mine["v"][:done]])}
            if window:
                keep = min(past + done, window - 1)
                piece["past_k"], piece["past_v"] = piece["past_k"][-keep:] if keep else piece["past_k"][:0], \
                    piece["past_v"][-keep:] if keep else piece["past_v"][:0]
            batch = [*others[: len(others) // 2], (past + done, size), *others[len(others) // 2 :]]
            mixed = layout(batch, kv_heads * group, kv_heads, dim, dtype, window, seed=seed + 1 + done,
                           tensors={len(others) // 2: piece})
            out = mixed.attend()
            q_start = mixed.requests[len(others) // 2, 0]
            rows.append(out[q_start : q_start + size])
            done += size
    finally:
        torch.set_num_threads(previous)
    return reference, torch.cat(rows)


@settings(max_examples=property_examples(30), deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), target=st.tuples(st.integers(0, 200),
       st.integers(1, 48)), others=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 30)), max_size=5),
       chunks=st.lists(st.integers(1, 48), min_size=1, max_size=4), window=windows, threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_a_rows_bits_depend_on_its_own_keys_only(dtype, target, others, chunks, window, threads, seed):
    reference, rows = _rows_alone_and_beside(dtype, target, others, [*chunks, target[1]], window, threads, seed)
    assert torch.equal(reference, rows)


def test_the_invariance_check_sees_a_moved_bit():
    # control: the same comparison, with the target's key blocks cut at other positions (its first position moved by
    # 7: the online softmax folds other groups of keys) must find rows whose bits moved; else the check is blind
    step = layout([(150, 20)], 6, 2, 32, torch.float32, seed=5)
    reference = step.attend(write=False)
    step.requests[0, 4] += 7
    moved = step.attend(write=False)
    torch.testing.assert_close(moved, reference, atol=1e-5, rtol=1e-5)  # the same attention, to rounding
    assert not torch.equal(moved, reference)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2"])
def test_the_kernel_built_for_another_cpu_kind_computes_the_same_and_stays_invariant(isa):
    # a fresh process held to AVX2 (torch reports that capability): the kernel is built for it (8-float vectors, so
    # other register shapes and a cache folder of its own) and must pass the same properties there
    pytest_under_isa(isa, __file__, "float32 or own_keys_only", examples=25)
