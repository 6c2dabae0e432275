"""cbgen.attention: the per-sequence attention gives the stock `sdpa` path's greedy tokens and logprobs (fp32), in
every kind of continuous batch, and leaves transformers as it found it."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from transformers import (
    AttentionInterface,
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import cbgen.attention.layout as layout
import cbgen.attention.paged_decode as paged_decode
import cbgen.attention.per_sequence as attention
import cbgen.attention.support as support
from cbgen.attention import cpu_attention_available, per_sequence_attention, per_sequence_sdpa_forward, registry

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
             max_position_embeddings=512)
GREEDY = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=None)


@pytest.fixture(autouse=True)
def quiet_engine():
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)


def load(model_class, config, folder, attn_implementation: str = "sdpa"):
    """Saves a random model and loads it back the way cbgen does (fp32, an explicit attention implementation)."""
    torch.manual_seed(0)
    model_class(config).save_pretrained(folder)
    return model_class.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn_implementation).eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load(LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, **SHAPE), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    config = MistralConfig(num_hidden_layers=2, sliding_window=24, **SHAPE)
    return load(MistralForCausalLM, config, tmp_path_factory.mktemp("mistral"))


def prompts(*lengths: int) -> list[list[int]]:
    rng = random.Random(sum(lengths))
    return [[rng.randrange(SHAPE["vocab_size"]) for _ in range(n)] for n in lengths]


def generate(model, inputs: list[list[int]], **batching) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for each prompt, in prompt order."""
    config = ContinuousBatchingConfig(**{"auto_switch_to_flash": False, "page_size": 16, "num_blocks": 256,
                                         "return_logprobs": True, **batching})
    outputs = model.generate_batch(inputs, GREEDY, config)
    by_prompt = {tuple(out.prompt_ids): (out.generated_tokens, out.logprobs) for out in outputs.values()}
    return [by_prompt[tuple(prompt)] for prompt in inputs]


@pytest.fixture
def batches(monkeypatch) -> list[layout.StepLayout]:
    """Records the layout of every batch the per-sequence path computes (it returns None for calls it hands back)."""
    seen: list[layout.StepLayout] = []
    plan = attention.step_layout

    def recording(*args, **kwargs):
        batch = plan(*args, **kwargs)
        assert batch is not None, "a continuous-batching call fell back to the stock attention"
        seen.append(batch)
        return batch

    monkeypatch.setattr(attention, "step_layout", recording)
    return seen


@pytest.fixture
def page_reads(monkeypatch) -> list[str]:
    """How each call's single-token requests read their keys (cbgen.attention.paged_decode.PageRead.kind): "in place"
    (views of the requests' range of blocks; "in place, reordered" when their rows are not in the requests' order,
    "in place, with gaps" when the range also has blocks of no request), "pages" (a gather of whole pages' rows),
    "rows" (token rows of requests that span pages), or "stock" (the layer took the stock update: layer_cache
    returned None)."""
    seen: list[str] = []
    read, layer_cache = attention.read_requests, attention.layer_cache

    def recording(*args, **kwargs):
        found = read(*args, **kwargs)
        kind = found.kind
        if found.rows is not None:
            kind += ", with gaps" if found.keys.shape[0] > found.rows.numel() else ", reordered"
        seen.append(kind)
        return found

    def recording_layer(*args, **kwargs):
        found = layer_cache(*args, **kwargs)
        if found is None:
            seen.append("stock")
        return found

    monkeypatch.setattr(attention, "read_requests", recording)
    monkeypatch.setattr(attention, "layer_cache", recording_layer)
    return seen


def assert_same_as_stock(model, inputs: list[list[int]], **batching) -> None:
    stock = generate(model, inputs, **batching)
    with per_sequence_attention(model, required=True) as active:
        assert active
        ours = generate(model, inputs, **batching)
    for (stock_tokens, stock_logprobs), (our_tokens, our_logprobs) in zip(stock, ours):
        assert len(our_tokens) == GREEDY.max_new_tokens
        assert our_tokens == stock_tokens
        assert our_logprobs == pytest.approx(stock_logprobs, abs=1e-5)


def is_fresh_prefill(batch) -> bool:
    return all(q > 1 and q == k for q, k in zip(batch.q_lengths, batch.k_lengths))


def is_chunk_after_prefix(batch) -> bool:
    return any(1 < q < k for q, k in zip(batch.q_lengths, batch.k_lengths))


def is_mixed(batch) -> bool:
    return 1 in batch.q_lengths and any(q > 1 for q in batch.q_lengths)


def is_padded_decode(batch) -> bool:
    return set(batch.q_lengths) == {1} and len(set(batch.k_lengths)) > 1


# ------------------------------------------------------------------------------------------------------------------ #


def test_prefill_then_padded_decode_match_stock(llama, batches):
    assert_same_as_stock(llama, prompts(7, 19, 33, 48, 64, 90))
    assert any(is_fresh_prefill(b) for b in batches)
    assert any(is_padded_decode(b) for b in batches)


def test_equal_length_decode_matches_stock(llama, batches):
    assert_same_as_stock(llama, prompts(24, 24, 24, 24))
    assert any(set(b.q_lengths) == {1} and len(set(b.k_lengths)) == 1 for b in batches)


def test_chunked_prefill_and_mixed_batches_match_stock(llama, batches, page_reads):
    assert_same_as_stock(llama, prompts(5, 26, 47, 68, 89, 110, 131, 150), max_batch_tokens=64, page_size=256)
    assert any(is_chunk_after_prefix(b) for b in batches)
    assert any(is_mixed(b) for b in batches)
    assert any(is_padded_decode(b) for b in batches)
    # no packed read-back: the decode requests of mixed steps read their pages, later chunks their cache rows
    assert page_reads and "stock" not in page_reads


def test_one_token_prompts_beside_longer_ones_match_stock(llama, batches, page_reads):
    # a one-token prompt's first step is a single query without a past: a chunk of its own, not a decode
    assert_same_as_stock(llama, prompts(1, 7, 1, 19), page_size=64)
    assert any(1 in b.q_lengths and 1 in b.k_lengths for b in batches)
    assert page_reads and "stock" not in page_reads


def test_decode_read_from_pages_matches_stock(llama, batches, page_reads):
    # pages of 64 tokens hold every request whole (prompt + 16 new): each decode step reads the requests' own pages,
    # padded to the longest, and the rows past a shorter request's end are masked
    assert_same_as_stock(llama, prompts(7, 19, 33, 40), page_size=64)
    assert any(is_padded_decode(b) for b in batches)
    # the engine hands out blocks from the top of its free list: the batch's rows run backwards through the range
    assert page_reads and set(page_reads) == {"in place, reordered"}


def test_one_request_attends_its_page_in_place(llama, page_reads):
    assert_same_as_stock(llama, prompts(33), page_size=64)
    assert page_reads and set(page_reads) == {"in place"}


def test_rows_out_of_order_and_gaps_attend_as_the_packed_keys():
    # a range of blocks read in place can run in another order than the batch and hold blocks of no request (a
    # finished request's): those rows get a zero query and are dropped; each request's output is what it gets from its
    # own keys gathered out of the packed read-back (to SDPA's rounding, which moves with a row's place in the batch)
    torch.manual_seed(0)
    kv_heads, group, dim, lengths = 2, 2, 8, [5, 9, 7]
    starts = [0, 5, 14]
    query = torch.randn(1, kv_heads * group, len(lengths), dim)
    key, value = torch.randn(1, kv_heads, sum(lengths), dim), torch.randn(1, kv_heads, sum(lengths), dim)
    batch = layout.StepLayout([0, 1, 2], [1, 1, 1], starts, lengths, None)
    expected = query.new_empty(len(lengths), kv_heads * group, dim)
    attention._attend_decode(query, key, value, batch, [0, 1, 2], None, expected)

    rows = torch.tensor([3, 0, 4])  # rows 1 and 2: blocks of no request, stale values
    keys, values = torch.randn(5, kv_heads, max(lengths), dim), torch.randn(5, kv_heads, max(lengths), dim)
    for row, start, length in zip(rows.tolist(), starts, lengths):
        keys[row, :, :length] = key[0, :, start : start + length]
        values[row, :, :length] = value[0, :, start : start + length]
    got = query.new_empty(len(lengths), kv_heads * group, dim)
    read = paged_decode.PageRead(keys, values, rows, "in place")
    attention._attend_decode(query, key, value, batch, [0, 1, 2], None, got, read)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_scattered_pages_are_gathered(llama, page_reads, monkeypatch):
    monkeypatch.setattr(paged_decode, "_SPAN_PER_REQUEST", 0)  # no range is compact enough
    assert_same_as_stock(llama, prompts(7, 19, 33, 40), page_size=64)
    assert page_reads and set(page_reads) == {"pages"}


def test_requests_longer_than_a_page_are_read_by_token_rows(llama, batches, page_reads):
    assert_same_as_stock(llama, prompts(7, 19, 70), page_size=64)  # the third spans two pages
    assert page_reads and set(page_reads) == {"rows"}
    assert any(is_padded_decode(b) for b in batches)


def test_sliding_window_model_matches_stock(mistral, batches):
    # prompts and chunks longer than the 24-token window, so the window changes the result
    assert_same_as_stock(mistral, prompts(5, 23, 41, 60, 77, 99), max_batch_tokens=32)
    assert {b.window for b in batches} == {24}
    assert any(k > 24 and q > 1 for b in batches for q, k in zip(b.q_lengths, b.k_lengths))


def test_full_and_sliding_layers_in_one_model_match_stock(tmp_path, batches):
    config = Qwen2Config(num_hidden_layers=3, sliding_window=24, use_sliding_window=True, max_window_layers=1, **SHAPE)
    model = load(Qwen2ForCausalLM, config, tmp_path)
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert_same_as_stock(model, prompts(5, 41, 77, 99), max_batch_tokens=32)
    assert {b.window for b in batches} == {None, 24}


def test_full_layers_of_a_hybrid_model_read_their_pages_in_place(tmp_path, page_reads):
    # the full-attention allocator's blocks hold its one layer only: its pages come every 2 pages, not every 6
    config = Qwen2Config(num_hidden_layers=3, sliding_window=24, use_sliding_window=True, max_window_layers=1, **SHAPE)
    model = load(Qwen2ForCausalLM, config, tmp_path)
    assert_same_as_stock(model, prompts(5, 41, 77, 99), max_batch_tokens=32, page_size=128)
    assert any(kind.startswith("in place") for kind in page_reads)
    # stock: the sliding layers; pages: steps where the few requests left hold blocks too far apart for a range
    assert set(page_reads) <= {"in place", "in place, reordered", "pages", "stock"}


def test_stock_attention_is_restored_and_plain_generate_unchanged(llama):
    stock = AttentionInterface()["sdpa"]
    inputs = torch.tensor(prompts(12, 12))
    before = llama.generate(inputs, generation_config=GREEDY, attention_mask=torch.ones_like(inputs))
    with per_sequence_attention(llama) as active:
        assert active
        assert registry.serving(llama, "sdpa", per_sequence_sdpa_forward)
        with per_sequence_attention(llama):  # nested: still installed after the inner block
            pass
        assert registry.serving(llama, "sdpa", per_sequence_sdpa_forward)
        inside = llama.generate(inputs, generation_config=GREEDY, attention_mask=torch.ones_like(inputs))
    assert AttentionInterface()["sdpa"] is stock and registry.bound_function(llama, "sdpa") is None
    after = llama.generate(inputs, generation_config=GREEDY, attention_mask=torch.ones_like(inputs))
    assert torch.equal(inside, before) and torch.equal(after, before)


def test_another_model_keeps_its_own_attention_and_a_second_function_is_refused(llama, tmp_path):
    """The registry routes by model: while one model's engine holds the per-sequence function, another model's calls
    reach the stock function; and one model takes one function at a time."""
    from cbgen.attention import batch_invariant_sdpa_forward
    from cbgen.errors import CbgenError

    other = load(LlamaForCausalLM, LlamaConfig(num_hidden_layers=1, **SHAPE), tmp_path)
    reached = []
    with per_sequence_attention(llama):
        original = registry.stock("sdpa")
        registry._PATCHES["sdpa"].original = lambda *args, **kwargs: reached.append(1) or original(*args, **kwargs)
        try:
            inputs = torch.tensor(prompts(6))
            other.generate(inputs, generation_config=GREEDY, attention_mask=torch.ones_like(inputs))
        finally:
            registry._PATCHES["sdpa"].original = original
        assert reached and registry.bound_function(other, "sdpa") is None
        with pytest.raises(CbgenError, match="one model runs one engine's attention at a time"):
            with registry.bound(llama, "sdpa", batch_invariant_sdpa_forward):
                pass
        assert registry.serving(llama, "sdpa", per_sequence_sdpa_forward)


def test_restored_when_the_block_raises(llama):
    stock = AttentionInterface()["sdpa"]
    with pytest.raises(KeyError), per_sequence_attention(llama):
        raise KeyError("boom")
    assert AttentionInterface()["sdpa"] is stock


def test_unsupported_model_stays_on_stock(tmp_path):
    eager = load(LlamaForCausalLM, LlamaConfig(num_hidden_layers=1, **SHAPE), tmp_path, attn_implementation="eager")
    stock = AttentionInterface()["sdpa"]
    assert not cpu_attention_available(eager)
    with per_sequence_attention(eager) as active:
        assert not active
        assert AttentionInterface()["sdpa"] is stock
    with pytest.raises(RuntimeError, match="attn_implementation='eager'"), per_sequence_attention(eager, required=True):
        pass


def test_unvalidated_transformers_version_stays_on_stock(llama, monkeypatch):
    import transformers

    assert cpu_attention_available(llama)
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    assert "5.99.0" in support.cpu_attention_unavailable_reason(llama)
    stock = AttentionInterface()["sdpa"]
    with per_sequence_attention(llama) as active:
        assert not active
        assert AttentionInterface()["sdpa"] is stock


def test_unusual_calls_are_handed_to_stock(llama):
    module = llama.model.layers[0].self_attn
    query, key, value = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    paged = object.__new__(PagedAttentionCache)  # only its type matters to this check

    def handled(dropout: float = 0.0, position_bias=None, cache=paged, **kwargs) -> bool:
        return attention.handled_call(module, query, key, value, dropout, position_bias, cache, kwargs)

    assert handled(cu_seq_lens_q=torch.tensor([0, 6]), sliding_window=None)
    assert not handled(cache=None)  # plain model.generate / forward
    assert not handled(dropout=0.1)
    assert not handled(softcap=30.0)
    assert not handled(s_aux=torch.zeros(4))  # attention sinks
    assert not handled(position_bias=torch.zeros(1, 4, 6, 6))

    # outside continuous batching the result is the stock function's, bit for bit
    ours, _ = per_sequence_sdpa_forward(module, query, key, value, None, scaling=0.25, is_causal=True)
    stock, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.25, is_causal=True)
    assert torch.equal(ours, stock)


def test_the_batch_layout_is_worked_out_once_per_forward_pass(llama, monkeypatch):
    layouts, passes = [], []
    layout = attention._layout
    monkeypatch.setattr(attention, "_layout", lambda *args: layouts.append(1) or layout(*args))
    with per_sequence_attention(llama, required=True):
        counting = llama.register_forward_pre_hook(lambda *_: passes.append(1))
        try:
            generate(llama, prompts(7, 19, 33, 40), page_size=64)
        finally:
            counting.remove()
    assert passes and len(layouts) == len(passes)  # one plan per pass, for both layers
    assert not llama._forward_pre_hooks and not llama._forward_hooks  # the memo's hooks are gone with the block


def test_nothing_is_remembered_outside_a_forward_pass():
    from cbgen.attention.pass_memo import remembered

    calls = []
    assert remembered("k", lambda: calls.append(1) or len(calls)) == 1
    assert remembered("k", lambda: calls.append(1) or len(calls)) == 2
