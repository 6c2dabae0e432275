"""cbgen.attention.dense_mask: while the per-sequence attention serves, the engine builds no dense attention mask, gives
the stock path's results without it, and keeps it wherever something could still read it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.continuous_batching import PagedAttentionCache, input_outputs

from cbgen.attention import dense_mask, per_sequence_sdpa_forward, registry
from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl


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


def test_transformers_is_told_no_mask_for_the_skipping_model_only(llama, tmp_path):
    needed = input_outputs.attn_mask_is_needed
    other = LlamaForCausalLM(llama.config.__class__(**llama.config.to_dict())).eval()  # its own config object
    other.config._attn_implementation = "sdpa"
    assert input_outputs.attn_mask_is_needed(llama.config)
    with dense_mask.skipped(llama):
        assert not input_outputs.attn_mask_is_needed(llama.config)
        assert input_outputs.attn_mask_is_needed(other.config)  # another model's engine keeps its mask
        assert input_outputs.attn_mask_is_needed(SimpleNamespace(_attn_implementation="paged|eager"))
        with dense_mask.skipped(llama):  # nested: still skipped after the inner block
            pass
        assert not dense_mask.built_for(llama.config)
        with dense_mask.skipped(other):
            assert not input_outputs.attn_mask_is_needed(other.config)
        assert input_outputs.attn_mask_is_needed(other.config)
    assert input_outputs.attn_mask_is_needed is needed and input_outputs.attn_mask_is_needed(llama.config)


def test_a_compiled_engine_keeps_the_mask(tiny_model_dir, tmp_path):
    """The plan keeps the mask where transformers compiles the forward pass (a compiled pass could reach the stock
    function): asked through the batching's compile level, the job says so before anything runs."""
    from cbgen.config import JobConfig, ModelSection
    from cbgen.engine.scope import PER_SEQUENCE
    from cbgen.engine.setup import _compiled, make_cb_config, plan_scope
    from cbgen.model.load import load_model

    job = JobConfig()
    job.model = ModelSection(model=str(tiny_model_dir), dtype="float32")
    loaded = load_model(job.model)
    plain, compiled = (make_cb_config(batching, job) for batching in ({}, {"default_compile_level": 1}))
    assert not plan_scope(job, loaded, PER_SEQUENCE, compiled=_compiled(plain, None)).dense_mask
    assert plan_scope(job, loaded, PER_SEQUENCE, compiled=_compiled(compiled, None)).dense_mask


def test_a_call_for_the_stock_attention_without_the_mask_is_refused(llama, monkeypatch):
    module = llama.model.layers[0].self_attn
    query, key, value = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    paged = object.__new__(PagedAttentionCache)  # only its type matters here
    bias = torch.zeros(1, 4, 6, 6)  # a position bias: a call the per-sequence path hands to the stock function
    with pytest.raises(RuntimeError, match="without the dense mask"):
        per_sequence_sdpa_forward(module, query, key, value, None, is_causal=True, cache=paged, position_bias=bias)
    # with the engine's mask (is_causal False) the call goes to the stock function, as before
    handed = []
    monkeypatch.setattr(registry, "stock", lambda name: lambda *args, **kwargs: handed.append(name) or (args[1], None))
    mask = torch.zeros(1, 1, 6, 6)
    per_sequence_sdpa_forward(module, query, key, value, mask, is_causal=False, cache=paged, position_bias=bias)
    assert handed == ["sdpa"]
