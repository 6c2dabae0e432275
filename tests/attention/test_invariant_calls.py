"""Batch-invariant attention as a property: for any batch a step can hold, every request's output rows are bitwise the
rows it gets alone (on 2 threads and on 1, as a --data-parallel replica runs), in bfloat16 and float32, for any
grouping of query heads, head size, key count across several 64-key buckets, prompt chunk and sliding window.

The fast subset draws a few dozen batches (the same ones in CI, derandomized); the slow suite draws many more, and
runs the fast property again with torch, oneDNN and MKL held to other instruction sets (AVX2, AVX-512 without bf16
units), so one machine exercises the kernels other CPU kinds would run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbgen.attention.invariant import attend_invariant
from cbgen.attention.layout import StepLayout
from tests.helpers import OTHER_ISAS, TWO_THREADS, property_examples, pytest_under_isa, torch_threads

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@st.composite
def batches(draw, max_requests: int = 12):
    """A step: its requests (query tokens, keys), the model's heads, and the layer's window."""
    num_kv_heads = draw(st.integers(1, 4))
    group = draw(st.integers(1, 5))
    head_dim = draw(st.sampled_from([16, 24, 64, 80]))
    window = draw(st.none() | st.integers(2, 80))
    requests = []
    for _ in range(draw(st.integers(1, max_requests))):
        keys = draw(st.integers(1, 300))
        decode = draw(st.booleans())
        queries = 1 if decode else draw(st.integers(1, min(keys, 40)))
        requests.append((queries, keys))
    return dict(num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, window=window, requests=requests,
                dtype=draw(st.sampled_from(sorted(DTYPES))), seed=draw(st.integers(0, 2**16)))


def _tensors(case):
    """Each request's queries, keys and values (random, from the case's seed)."""
    generator = torch.Generator().manual_seed(case["seed"])
    heads = case["num_kv_heads"] * case["group"]
    dtype = DTYPES[case["dtype"]]
    return [(torch.randn(q, heads, case["head_dim"], generator=generator).to(dtype),
             torch.randn(k, case["num_kv_heads"], case["head_dim"], generator=generator).to(dtype),
             torch.randn(k, case["num_kv_heads"], case["head_dim"], generator=generator).to(dtype))
            for q, k in case["requests"]]


def _attend(case, tensors) -> torch.Tensor:
    """The requests as one step: packed queries, keys request by request, every token attended invariantly."""
    batch = StepLayout([], [], [], [], case["window"])
    q_at = k_at = 0
    for query, key, _ in tensors:
        batch.q_starts.append(q_at)
        batch.q_lengths.append(query.shape[0])
        batch.k_starts.append(k_at)
        batch.k_lengths.append(key.shape[0])
        q_at, k_at = q_at + query.shape[0], k_at + key.shape[0]
    query = torch.cat([q for q, _, _ in tensors]).transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, dim]
    out = query.new_zeros(q_at, query.shape[1], case["head_dim"])
    attend_invariant(query, torch.cat([k for _, k, _ in tensors]), torch.cat([v for _, _, v in tensors]), None,
                     batch, None, out)
    return out


def _check(case) -> None:
    with torch_threads(TWO_THREADS):  # the batch on two threads, request 0 again on one
        _check_on_two_threads(case)


def _check_on_two_threads(case) -> None:
    tensors = _tensors(case)
    together = _attend(case, tensors)
    threads = torch.get_num_threads()
    start = 0
    for i, request in enumerate(tensors):
        length = request[0].shape[0]
        alone = _attend(case, [request])
        assert torch.equal(together[start:start + length], alone), f"request {i} moved with the batch"
        if i == 0:
            try:
                torch.set_num_threads(1)
                assert torch.equal(_attend(case, [request]), alone), "request 0 moved with the thread count"
            finally:
                torch.set_num_threads(threads)
        start += length


FAST = settings(max_examples=property_examples(40), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(batches())
def test_a_request_attends_as_it_would_alone(case):
    _check(case)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_requests=24))
def test_a_request_attends_as_it_would_alone_many_batches(case):
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(OTHER_ISAS))
def test_the_property_holds_on_other_instruction_sets(isa):
    pytest_under_isa(isa, __file__, "test_a_request_attends_as_it_would_alone and not many")
