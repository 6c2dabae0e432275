"""Resolving --model, --dtype, --device and --attn-implementation."""

from __future__ import annotations

import pytest
import torch

from cbgen import model
from cbgen.config import ModelSection
from cbgen.errors import CbgenError


def test_embedded_default(monkeypatch):
    source = model.resolve_source(None)
    assert source.gguf_file == model.EMBEDDED_FILE and "embedded" in source.name


def test_gguf_file_folder_and_hub_id(tmp_path, tiny_model_dir):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert model.resolve_source(str(gguf)) == model.ModelSource(str(gguf), str(tmp_path), "m.gguf")
    assert model.resolve_source(str(tiny_model_dir)).location == str(tiny_model_dir)
    assert model.resolve_source("Qwen/Qwen3-4B").location == "Qwen/Qwen3-4B"


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(CbgenError, match="has no config.json"):
        model.resolve_source(str(tmp_path))


def test_dtype_auto_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(model, "cpu_has_bf16_units", lambda: True)
    assert model.resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(model, "cpu_has_bf16_units", lambda: False)
    assert model.resolve_dtype("auto", "cpu") is torch.float32
    assert model.resolve_dtype("auto", "cuda") is torch.bfloat16
    assert model.resolve_dtype("float16", "cpu") is torch.float16


def test_cuda_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CbgenError, match="no CUDA device"):
        model.resolve_device("cuda")
    assert model.resolve_device("auto") == "cpu"


def test_attention_defaults(monkeypatch):
    assert model.resolve_attn_implementation(None, "cpu") == "sdpa"
    assert model.resolve_attn_implementation("paged|eager", "cpu") == "paged|eager"


def test_tiny_model_loads_with_tokenizer(tiny_model_dir):
    settings = ModelSection(model=str(tiny_model_dir), dtype="float32")
    loaded = model.load_model(settings)
    assert loaded.dtype is torch.float32 and loaded.device == "cpu" and loaded.attn_implementation == "sdpa"
    assert loaded.tokenizer.chat_template and loaded.model.config.num_hidden_layers == 2
