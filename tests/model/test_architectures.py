"""Under the default attention choice, every architecture family cbgen expects gives fp32 greedy tokens identical to
`model.generate`: plain (Llama, Qwen, OLMo 2, Granite), sliding-window (Mistral, Phi-3), hybrid sliding/full with
soft-capping (Gemma 2, Gemma 3), attention sinks (gpt-oss) and MoE (Qwen3-MoE, Mixtral). The prompts are longer
than the sliding windows (16 tokens), so the windows bind. Every model cbgen's CPU attention serves runs its compiled
kernel (cbgen.attention.compiled), the default; Llama, Qwen2, Qwen3 and Mistral run cbgen's fused decoder layers
(cbgen.model.fused), the others transformers' own."""

from __future__ import annotations

import json

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2)
GEMMA2 = dict(model_type="gemma2", head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
COMPILED = "per-sequence, compiled kernel (batch-invariant by construction)"
# architecture: (config kwargs, the attention cbgen runs it with on CPU)
ARCHITECTURES = {
    "llama": (dict(model_type="llama"), COMPILED),
    "qwen2": (dict(model_type="qwen2"), COMPILED),
    "qwen3": (dict(model_type="qwen3", head_dim=16), COMPILED),
    "mistral": (dict(model_type="mistral", sliding_window=16), COMPILED),
    "phi3": (dict(model_type="phi3", sliding_window=16), COMPILED),
    "gemma2": (GEMMA2, "stock, soft-capped"),  # no sdpa in transformers: eager, run as paged|eager
    # a cap that binds (small cap, larger weights): transformers' paged eager attention alone drops it
    "gemma2-tight-cap": (dict(GEMMA2, attn_logit_softcapping=1.0, initializer_range=0.1), "stock, soft-capped"),
    "gemma3": (dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"]), COMPILED),
    "gpt-oss": (dict(model_type="gpt_oss", head_dim=16, sliding_window=16, num_local_experts=4,
                     num_experts_per_tok=2, intermediate_size=64, max_position_embeddings=131072), "stock"),
    "qwen3-moe": (dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True), COMPILED),
    "mixtral": (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2), COMPILED),
    "olmo2": (dict(model_type="olmo2"), COMPILED),
    "granite": (dict(model_type="granite", embedding_multiplier=12.0, attention_multiplier=0.015625,
                     residual_multiplier=0.22, logits_scaling=8.0), COMPILED),
}
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could print many pages quickly.",
    "To make a simple tomato sauce, warm olive oil in a heavy pan, add sliced garlic and a pinch of chilli, then "
    "pour in crushed tomatoes, season with salt, and let everything simmer gently for about twenty minutes.",
]
NEW_TOKENS = 8
FUSED = {"llama", "qwen2", "qwen3", "mistral"}  # the architectures cbgen's fused decoder layers serve


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Counts the forward passes whose attention cbgen's compiled kernel computed itself (not handed back)."""
    import cbgen.attention.compiled as compiled

    computed = []
    requests = compiled._requests

    def counting(batch):
        computed.append(1)
        return requests(batch)

    monkeypatch.setattr(compiled, "_requests", counting)
    return computed


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_default_attention_matches_generate(name, tiny_model_dir, tmp_path, kernel_calls):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs, attention = ARCHITECTURES[name]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.for_model(**{**BASE, "vocab_size": len(tokenizer), **kwargs})
    torch.manual_seed(0)
    folder = tmp_path / name
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"t{i}", "prompt": text} for i, text in enumerate(TEXTS)])
    out = tmp_path / "out"
    assert run_cli(["run", str(prompts), "-o", str(out), "--model", str(folder), "--dtype", "float32",
                    "--raw-prompts", "--max-new-tokens", str(NEW_TOKENS), "-q"]) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["attention"] == attention
    assert manifest["engine_scope"]["decoder_layers"]["fused"] is (name in FUSED), manifest["engine_scope"]
    assert bool(kernel_calls) == (attention == COMPILED)  # it computed, not only handed back
    rows = {r["id"]: r for r in read_shards(out)}

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for i, text in enumerate(TEXTS):
        ids = tokenizer(text)["input_ids"]
        assert len(ids) > 2 * 16  # longer than the sliding windows
        expected = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
        assert rows[f"t{i}"]["token_ids"] == expected, name
