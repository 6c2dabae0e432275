"""Resolving --model, --dtype, --device and --attn-implementation."""

from __future__ import annotations

import pytest
import torch

from cbgen.config import ModelSection
from cbgen.errors import CbgenError
from cbgen.model import gguf as model_cache
from cbgen.model import load as model_load
from cbgen.model import source as model_source


def test_embedded_default(monkeypatch):
    source = model_source.resolve_source(None)
    assert source.gguf_file == model_source.EMBEDDED_FILE and "embedded" in source.name


def test_gguf_file_folder_and_hub_id(tmp_path, tiny_model_dir):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_source.resolve_source(str(gguf)) == model_source.ModelSource(str(gguf), str(tmp_path), "m.gguf")
    assert model_source.resolve_source(str(tiny_model_dir)).location == str(tiny_model_dir)
    assert model_source.resolve_source("Qwen/Qwen3-4B").location == "Qwen/Qwen3-4B"


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(CbgenError, match="has no config.json"):
        model_source.resolve_source(str(tmp_path))


def test_dtype_auto_follows_the_hardware(monkeypatch):
    from cbgen.config import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "amx_bf16"}))
    assert model_load.resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert model_load.resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert model_load.resolve_dtype("auto", "cuda") is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # a GPU without bf16: float16
    assert model_load.resolve_dtype("auto", "cuda") is torch.float16
    assert model_load.resolve_dtype("float16", "cpu") is torch.float16


def test_cuda_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CbgenError, match="no CUDA device"):
        model_load.resolve_device("cuda")
    assert model_load.resolve_device("auto") == "cpu"


def test_attention_defaults(monkeypatch):
    """Unnamed, the attention is transformers' choice for the model (sdpa where it has one, else eager); on CUDA,
    flash attention where it is installed and the model supports it. A named one is taken as is."""
    import transformers.utils

    assert model_load.resolve_attn_implementation(None, "cpu") is None
    assert model_load.resolve_attn_implementation("paged|eager", "cpu") == "paged|eager"
    assert model_load.resolve_attn_implementation("per-sequence", "cpu") == "sdpa"
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert model_load.resolve_attn_implementation(None, "cuda", lambda: True) == "flash_attention_2"
    assert model_load.resolve_attn_implementation(None, "cuda", lambda: False) is None
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert model_load.resolve_attn_implementation(None, "cuda", lambda: True) is None


def test_tiny_model_loads_with_tokenizer(tiny_model_dir):
    settings = ModelSection(model=str(tiny_model_dir), dtype="float32")
    loaded = model_load.load_model(settings)
    assert loaded.dtype is torch.float32 and loaded.device == "cpu" and loaded.attn_implementation == "sdpa"
    assert loaded.tokenizer.chat_template and loaded.model.config.num_hidden_layers == 2


# Random-weight models


def test_random_weight_names_resolve():
    for spec in ("llama-1b", "LLaMA-1B", "random-weights:llama-1b"):
        source = model_source.resolve_source(spec)
        assert source == model_source.ModelSource("random-weights:llama-1b", "llama-1b", random_weights=True)
    assert model_source.resolve_source("gpt2").random_weights is False  # a hub id without an owner stays a hub id


@pytest.mark.parametrize("spec", ["random-weights:llama-2b", "lama-1b", "qwen3-4", "random-weights:nope"])
def test_unknown_shape_lists_the_known_ones(spec):
    with pytest.raises(CbgenError, match="known: smollm2-135m, llama-1b") as error:
        model_source.resolve_source(spec)
    assert "\n" not in str(error.value)


def test_missing_config_json_is_refused(tmp_path):
    with pytest.raises(CbgenError, match="does not exist"):
        model_source.resolve_source(str(tmp_path / "config.json"))


# Parameter counts of the public checkpoints, to 3 significant digits: the shapes are theirs.
PUBLIC_SIZES = {"smollm2-135m": 134.5e6, "llama-1b": 1.236e9, "llama-3b": 3.213e9, "llama-8b": 8.030e9,
                "qwen3-0.6b": 0.596e9, "qwen3-1.7b": 1.721e9, "qwen3-4b": 4.022e9, "qwen3-8b": 8.191e9}


@pytest.mark.parametrize("name", list(model_source.RANDOM_SHAPES))
def test_random_shapes_match_the_public_models(name):
    from transformers import AutoModelForCausalLM

    config = model_source.random_model_config(model_source.resolve_source(name))
    with torch.device("meta"):  # shapes only, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in skeleton.parameters())
    assert count == pytest.approx(PUBLIC_SIZES[name], rel=2e-3)
    assert config.vocab_size >= 49152 and config.eos_token_id == 2


@pytest.mark.slow
def test_random_shape_loads_with_the_embedded_tokenizer(tmp_path_factory):
    cache_dir = tmp_path_factory.getbasetemp() / "model-cache"
    loaded = model_load.load_model(ModelSection(model="smollm2-135m", dtype="float32", cache_dir=str(cache_dir)))
    assert loaded.random_weights and loaded.source.name == "random-weights:smollm2-135m"
    config = loaded.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (576, 30, 9, 3, 1536, 49152)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight  # tied
    assert loaded.model.dtype == torch.float32 and len(loaded.tokenizer) == 49152
    assert loaded.tokenizer.chat_template


def tiny_config_json(folder, vocab_size: int):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, eos_token_id=2).save_pretrained(folder)
    return folder / "config.json"


def test_config_json_loads_with_random_weights(tmp_path, tmp_path_factory):
    cache_dir = str(tmp_path_factory.getbasetemp() / "model-cache")
    path = tiny_config_json(tmp_path, 49152)
    first = model_load.load_model(ModelSection(model=str(path), dtype="bfloat16", cache_dir=cache_dir))
    assert first.random_weights and first.source.name == f"random-weights:{path}"
    assert first.model.config.num_hidden_layers == 2 and first.model.config.hidden_size == 64
    assert first.model.dtype == torch.bfloat16
    again = model_load.load_model(ModelSection(model=f"random-weights:{path}", dtype="bfloat16", cache_dir=cache_dir))
    assert again.cache == model_cache.CACHE_HIT  # the embedded tokenizer, from the cache
    for name, tensor in first.model.state_dict().items():  # seeded: the same weights every run
        assert torch.equal(again.model.state_dict()[name], tensor), name


def test_config_with_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path, tmp_path_factory):
    path = tiny_config_json(tmp_path, 1000)
    cache_dir = str(tmp_path_factory.getbasetemp() / "model-cache")
    with pytest.raises(CbgenError, match="vocab_size 1000 is smaller than the SmolLM2 tokenizer's 49152"):
        model_load.load_model(ModelSection(model=str(path), cache_dir=cache_dir))


def test_the_structure_alone_plans_with_the_checkpoints_generation_config(tmp_path, tiny_model_dir):
    """A dry run and a --data-parallel main process load no weights, but they plan the job (stop tokens, sampling
    defaults) and must see the checkpoint's generation_config.json as loading the weights does."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 7], "temperature": 0.6,
                                                               "do_sample": True}))
    settings = ModelSection(model=str(folder), dtype="float32", device="cpu")
    structure = model_load.load_model(settings, weights=False)
    loaded = model_load.load_model(settings)
    assert next(structure.model.parameters()).device.type == "meta"
    for config in (structure.model.generation_config, loaded.model.generation_config):
        assert config.eos_token_id == [eos, 7] and config.temperature == 0.6
