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


def test_the_paths_alternate_round_after_round_and_tokens_are_at_the_median(monkeypatch, tmp_path):
    # the full run times every path once a round, two rounds, so one disturbed minute cannot decide a goal alone;
    # both cbgen models are loaded and warmed before the first timed run
    from types import SimpleNamespace

    from cbgen.bench import llamacpp, machine, paths
    from cbgen.bench.suite import Timings
    from cbgen.bench.workloads import BenchWorkload, Measurement
    from cbgen.model import load

    monkeypatch.setenv("CBGEN_CPU_KIND", "avx512-bf16")
    calls: list[str] = []
    seconds = iter([10.0, 12.0, 20.0, 13.0, 14.0, 30.0, 11.0, 50.0, 20.0, 16.0])

    class FakeBench:
        def __init__(self, loaded, options, settings):
            self.name = "int8" if settings.quantize == "auto" else settings.dtype

        def cbgen(self, workload, invariant=None):
            warm = workload is not timed
            calls.append(f"{self.name}{' warm' if warm else ''}{' stock' if invariant is False else ''}")
            return Measurement("fixed", "cbgen", 1.0 if warm else next(seconds), 4, 256, 64)

        def llamacpp(self, workload, file, parallel, reference, path):
            calls.append(f"{path} after {reference.seconds:g}")
            return Measurement("fixed", path, next(seconds), 4, 256, 64)

    timed = BenchWorkload("fixed", [list(range(64))] * 4, 16)
    monkeypatch.setattr(load, "load_model", lambda settings: SimpleNamespace(model=None, tokenizer=None))
    monkeypatch.setattr(machine, "parameter_count", lambda model: 1)
    monkeypatch.setattr(paths, "Bench", FakeBench)
    monkeypatch.setattr(llamacpp, "bindings", lambda: (object(), None))
    monkeypatch.setattr(scale, "_workload", lambda tokenizer, plan: timed)
    ctx = SimpleNamespace(plan=Plan.of(False, "small"), log=print)
    t = Timings()
    tokens, parameters, measured = scale._timed(ctx, t, "llama-1b", tmp_path, tmp_path / "f.gguf", tmp_path / "q.gguf")
    assert calls == ["bfloat16 warm", "int8 warm"] + [
        "bfloat16", "bfloat16 stock", "int8", "llama.cpp bf16 after 10", "llama.cpp Q8_0 after 10",
        "bfloat16", "bfloat16 stock", "int8", "llama.cpp bf16 after 30", "llama.cpp Q8_0 after 30"]
    assert [s.value for s in t.samples["cbgen bfloat16, llama-1b"]] == [10.0, 30.0]
    assert [s.value for s in t.samples["llama.cpp Q8_0, llama-1b"]] == [14.0, 16.0]
    assert tokens["cbgen bfloat16"] == pytest.approx(320 / 20.0) and tokens["llama.cpp Q8_0"] == pytest.approx(320 / 15)
    assert parameters == 1 and measured is timed
    assert Plan.of(True, "small").scale_rounds == 1
