"""The suite's scale section (cbgen.bench.scale): what it needs before it measures, said in one line where the
machine lacks it; the parameter count behind its MFU; its goals."""

from __future__ import annotations

import pytest
import torch

from cbgen.bench import scale
from cbgen.bench.suite import Plan
from cbgen.model.source import RANDOM_SHAPES


@pytest.mark.parametrize("shape", ["smollm2-135m", "llama-1b", "qwen3-4b", "llama-8b"])
def test_the_parameter_count_is_the_models(shape):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**RANDOM_SHAPES[shape])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert scale._parameters(RANDOM_SHAPES[shape]) == sum(p.numel() for p in model.parameters()) - norms


def test_a_shape_the_memory_cannot_hold_is_said_not_made(monkeypatch, tmp_path):
    monkeypatch.setenv("CBGEN_LLAMACPP_DIR", str(tmp_path))
    monkeypatch.setattr(scale, "_memory_bytes", lambda: 24 * 2**30)
    why = scale.prepared("qwen3-4b", print)
    assert isinstance(why, str) and "4.0B parameters" in why and "24 GiB" in why
    assert not list(tmp_path.iterdir())
    why = scale.prepared("llama-1b", print)  # it fits, but llama.cpp is not built here
    assert isinstance(why, str) and why.startswith("no llama.cpp converter") and "build_llamacpp.sh" in why


def test_the_goals_are_the_1b_shapes_and_tiny_runs_none():
    from cbgen.bench.sections import section_goals

    names = [name for name, _ in section_goals("scale", Plan.of(True, "small"))]
    assert names and all("llama-1b" in name for name in names)
    assert section_goals("scale", Plan.of(True, "tiny")) == ()
    assert scale.scale(type("Ctx", (), {"plan": Plan.of(True, "tiny")})()) == []


@pytest.mark.parametrize(("kind", "dtype", "gguf"), [("avx2", "float32", "f32"), ("avx512-bf16", "bfloat16", "bf16"),
                                                     ("amx-bf16", "bfloat16", "bf16")])
def test_the_model_precision_is_the_kinds_dtype_in_goals_and_files(monkeypatch, tmp_path, kind, dtype, gguf):
    # a bf16 CPU compares cbgen in bfloat16 with llama.cpp's bf16 file, and its MFU is over the bf16 matmul rate
    monkeypatch.setenv("CBGEN_CPU_KIND", kind)
    assert scale.precision() == (dtype, gguf)
    names = [name for name, _ in scale.goals(Plan.of(False, "small"))]
    assert f"cbgen {dtype} vs llama.cpp {gguf}, llama-1b" in names
    assert f"cbgen {dtype} MFU, llama-1b" in names and f"cbgen int8 vs cbgen {dtype}, llama-1b" in names
    # the files the section asks llama.cpp's converter for
    made = []
    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text("import sys\nopen(sys.argv[sys.argv.index('--outfile') + 1], 'w').write(sys.argv[3])\n")
    monkeypatch.setenv("CBGEN_LLAMACPP_DIR", str(tmp_path))
    monkeypatch.setattr(scale, "_converter", lambda: converter)
    monkeypatch.setattr(scale, "_save_random", lambda shape, folder: made.append(folder) or (
        folder.mkdir(parents=True), (folder / "config.json").write_text("{}")))
    folder, floats, q8_0 = scale.prepared("llama-1b", print)
    assert made == [folder]
    assert floats.name == f"llama-1b-{gguf}.gguf" and floats.read_text() == gguf
    assert q8_0.name == "llama-1b-q8_0.gguf" and q8_0.read_text() == "q8_0"
