"""cbgen.attention.dense_mask: while the per-sequence attention serves, the engine builds no dense attention mask, gives
the stock path's results without it, and keeps it wherever something could still read it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.continuous_batching import PagedAttentionCache, input_outputs

from cbgen.attention import dense_mask, per_sequence_attention, per_sequence_sdpa_forward, support
from cbgen.cli import run_cli
from cbgen.outputs import read_shards
from tests.helpers import write_jsonl

UNCOMPILED = SimpleNamespace(varlen_compile_config=None, decode_compile_config=None)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_a_job_without_the_mask_gives_the_stock_attentions_tokens(tiny_model_dir, tmp_path):
    # prompts of several pages' lengths, a small token budget: prompt chunks, chunks after a prefix and decode steps
    # share batches
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": "word " * (5 + 37 * i)} for i in range(5)])

    def run(out: str, *extra: str) -> tuple[list, dict]:
        assert run_cli(["run", str(prompts), "-o", str(tmp_path / out), "--model", str(tiny_model_dir), "--dtype",
                        "float32", "--max-new-tokens", "10", "--logprobs", "--max-batch-tokens", "64", "-q",
                        *extra]) == 0
        rows = sorted(read_shards(tmp_path / out), key=lambda r: r["id"])
        manifest = json.loads((tmp_path / out / "run.json").read_text())
        return [(r["id"], r["token_ids"], r["logprobs"]) for r in rows], manifest["kv_cache"]

    ours, our_cache = run("ours")
    stock, stock_cache = run("stock", "--attn-implementation", "sdpa")
    assert our_cache["dense_attention_mask"].startswith("not built")
    assert stock_cache["dense_attention_mask"] == "built"
    assert [(i, tokens) for i, tokens, _ in ours] == [(i, tokens) for i, tokens, _ in stock]
    assert all(len(tokens) == 10 for _, tokens, _ in ours)
    for (_, _, our_logprobs), (_, _, stock_logprobs) in zip(ours, stock):
        assert our_logprobs == pytest.approx(stock_logprobs, abs=1e-5)


def test_transformers_is_told_no_mask_only_while_the_per_sequence_attention_serves(llama):
    needed = input_outputs.attn_mask_is_needed
    with dense_mask.without_dense_mask(UNCOMPILED) as skipped:  # the stock attention serves: keep the mask
        assert not skipped and input_outputs.attn_mask_is_needed is needed
    with per_sequence_attention(llama):
        with dense_mask.without_dense_mask(UNCOMPILED) as skipped:
            assert skipped
            assert not input_outputs.attn_mask_is_needed(llama.config)
            assert input_outputs.attn_mask_is_needed(SimpleNamespace(_attn_implementation="paged|eager"))
            with dense_mask.without_dense_mask(UNCOMPILED):  # nested: still in place after the inner block
                pass
            assert not input_outputs.attn_mask_is_needed(llama.config)
        assert input_outputs.attn_mask_is_needed is needed
        assert input_outputs.attn_mask_is_needed(llama.config)
        compiled = SimpleNamespace(varlen_compile_config=object(), decode_compile_config=None)
        with dense_mask.without_dense_mask(compiled) as skipped:  # a compiled forward pass: keep the mask
            assert not skipped and input_outputs.attn_mask_is_needed is needed


def test_a_call_for_the_stock_attention_without_the_mask_is_refused(llama, monkeypatch):
    module = llama.model.layers[0].self_attn
    query, key, value = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    paged = object.__new__(PagedAttentionCache)  # only its type matters here
    bias = torch.zeros(1, 4, 6, 6)  # a position bias: a call the per-sequence path hands to the stock function
    with pytest.raises(RuntimeError, match="without the dense mask"):
        per_sequence_sdpa_forward(module, query, key, value, None, is_causal=True, cache=paged, position_bias=bias)
    # with the engine's mask (is_causal False) the call goes to the stock function, as before
    handed = []
    monkeypatch.setattr(support, "stock", lambda name: lambda *args, **kwargs: handed.append(name) or (args[1], None))
    mask = torch.zeros(1, 1, 6, 6)
    per_sequence_sdpa_forward(module, query, key, value, mask, is_causal=False, cache=paged, position_bias=bias)
    assert handed == ["sdpa"]
