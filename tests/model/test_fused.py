"""Fused decoder layers (cbgen.model.fused): the architectures they were written for compute what transformers'
layers compute, the scope puts the model back exactly, the engine's linear kind reaches the merged projections, and
a model they do not fit keeps transformers' layers, saying why."""

from __future__ import annotations

import json

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.model import fused
from cbgen.model.fused import decoder_layers, fused_layers, separate, unfit_reason
from cbgen.model.invariant import batch_invariant_linear
from cbgen.model.linear import ROW_BUCKETS, linear_layers
from tests.helpers import write_jsonl

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=256)
FITTING = {
    "llama": dict(model_type="llama"),
    "llama, biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral": dict(model_type="mistral", sliding_window=8),
}
NOT_FITTING = {
    "gemma": (dict(model_type="gemma", head_dim=16), "GemmaDecoderLayer"),
    "gelu": (dict(model_type="llama", hidden_act="gelu"), "activation"),
    "olmo2": (dict(model_type="olmo2"), "Olmo2DecoderLayer"),
}


def _model(kwargs: dict, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**SMALL, **kwargs})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if kwargs.get("attention_bias"):  # transformers starts biases at zero: give them values that matter
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("name", list(FITTING))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_compute_what_transformers_layers_compute(name, dtype):
    model = _model(FITTING[name], dtype)
    assert unfit_reason(model) is None
    ids = torch.randint(3, 300, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        with fused_layers(model):
            assert all("forward" in vars(layer) for layer in decoder_layers(model))
            fused = model(ids).logits
    # float32: the same operators, the merged matmuls summing in the same order (a BLAS may still round the wider
    # matrix apart in the last bit); bfloat16: within a bfloat16 rounding of the logits
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(fused.argmax(-1), expected.argmax(-1))


def _storages(model) -> list[int]:
    return [p.untyped_storage().data_ptr() for p in model.parameters()]


def test_the_scope_puts_the_model_back():
    model = _model(FITTING["llama, biases"])
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    with fused_layers(model) as merged:
        attention = decoder_layers(model)[0].self_attn
        # the projections are views of the merged weight: nothing held twice
        assert attention.k_proj.weight.data_ptr() != pointers["model.layers.0.self_attn.k_proj.weight"]
        assert attention.q_proj.weight.untyped_storage().data_ptr() == merged.linears[0].weight.untyped_storage(
        ).data_ptr()
    assert all("forward" not in vars(m) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # the merge is the model's own: its projections stay views of it, until `separate` gives each its own storage
    # again (saving would refuse tensors that share memory)
    assert len(set(_storages(model))) < len(_storages(model))
    separate(model)
    assert len(set(_storages(model))) == len(_storages(model))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_weights_are_merged_once_per_model(monkeypatch):
    model = _model(FITTING["qwen2"])
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    merges: list = []
    original = fused._merged
    monkeypatch.setattr(fused, "_merged", lambda parts: merges.append(parts) or original(parts))
    with torch.no_grad():
        with fused_layers(model) as first:
            expected = model(ids).logits
        assert len(merges) == 2 * 2  # per layer qkv, gate_up
        with fused_layers(model) as second:
            again = model(ids).logits
        assert len(merges) == 2 * 2  # nothing merged again, nothing copied back in between
        assert [m.weight.data_ptr() for m in first.linears] == [m.weight.data_ptr() for m in second.linears]
        assert torch.equal(expected, again)
        # a weight replaced since (loaded anew, moved): that layer's group is merged again, from the new weights
        q_proj = decoder_layers(model)[1].self_attn.q_proj
        q_proj.weight = torch.nn.Parameter(q_proj.weight.detach().clone() * 2)
        stock = model(ids).logits
        with fused_layers(model) as third:
            changed = model(ids).logits
    assert len(merges) == 2 * 2 + 1
    assert q_proj.weight.untyped_storage().data_ptr() == third.linears[2].weight.untyped_storage().data_ptr()
    torch.testing.assert_close(changed, stock, atol=1e-5, rtol=1e-5)


def test_the_linear_kind_reaches_the_merged_projections():
    model = _model(FITTING["qwen2"], torch.bfloat16)
    with fused_layers(model) as merged, linear_layers(model, ROW_BUCKETS, merged) as switched:
        layer = decoder_layers(model)[0]
        assert all("forward" in vars(linear) for linear in merged.linears)
        assert "forward" not in vars(layer.self_attn.q_proj)  # computed through the merged one, not switched
        assert "forward" in vars(layer.self_attn.o_proj) and "forward" in vars(layer.mlp.down_proj)
        assert switched == 2 * 2 + 2 * 2 + 1  # per layer qkv, gate_up, o_proj, down_proj; the output head
    with fused_layers(model) as merged, batch_invariant_linear(model, merged):
        assert all("forward" in vars(linear) for linear in merged.linears)
        assert "forward" not in vars(decoder_layers(model)[0].mlp.up_proj)
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.parametrize("name", list(NOT_FITTING))
def test_a_model_they_do_not_fit_is_named(name):
    kwargs, words = NOT_FITTING[name]
    assert words in (unfit_reason(_model(kwargs)) or "")


def test_a_patched_layer_is_left_alone():
    model = _model(FITTING["llama"])
    norm = decoder_layers(model)[1].post_attention_layernorm
    norm.forward = lambda x: x  # another library's patch
    assert "LlamaRMSNorm does not run transformers' own forward" in (unfit_reason(model) or "")


def _save(model, tiny_model_dir, folder):
    from transformers import AutoTokenizer

    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def test_a_job_falls_back_and_says_why(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    folder = _save(_model({**NOT_FITTING["gelu"][0], "vocab_size": vocab}), tiny_model_dir, tmp_path / "gelu")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello there"}])
    args = ["run", str(prompts), "--model", str(folder), "--dtype", "float32", "--raw-prompts", "--max-new-tokens", "3",
            "-q"]
    assert run_cli([*args, "-o", str(tmp_path / "out")]) == 0
    scope = json.loads((tmp_path / "out" / "run.json").read_text())["engine_scope"]
    assert scope["decoder_layers"]["fused"] is False and "activation" in scope["decoder_layers"]["why"]
    # asked for by name where it cannot apply: one line naming the flag
    capsys.readouterr()
    assert run_cli([*args, "-o", str(tmp_path / "asked"), "--fused-layers"]) != 0
    err = capsys.readouterr().err
    assert "--fused-layers does not apply here" in err and "Traceback" not in err
    # a model it fits runs fused by default, and --no-fused-layers turns it off
    folder = _save(_model({**FITTING["llama"], "vocab_size": vocab}), tiny_model_dir, tmp_path / "llama")
    for extra, on in (([], True), (["--no-fused-layers"], False)):
        out = tmp_path / f"llama{len(extra)}"
        args[args.index("--model") + 1] = str(folder)
        assert run_cli([*args, "-o", str(out), *extra]) == 0
        assert json.loads((out / "run.json").read_text())["engine_scope"]["decoder_layers"]["fused"] is on
