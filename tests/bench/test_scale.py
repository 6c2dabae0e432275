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


@pytest.mark.parametrize("vnni", [False, True])
def test_the_paths_alternate_round_after_round_and_tokens_are_at_the_median(monkeypatch, tmp_path, vnni):
    # the full run times every path once a round, two rounds, so one disturbed minute cannot decide a goal alone;
    # every cbgen model is loaded and warmed before the first timed run; w8a8 runs where its kernel has VNNI
    from types import SimpleNamespace

    from cbgen.bench import llamacpp, machine, paths
    from cbgen.bench.suite import Timings
    from cbgen.bench.workloads import BenchWorkload, Measurement
    from cbgen.model import load

    monkeypatch.setenv("CBGEN_CPU_KIND", "avx512-bf16")
    calls: list[str] = []
    w8a8 = [9.0, 8.0] if vnni else []
    seconds = iter([10.0, 12.0, 20.0, *w8a8[:1], 13.0, 14.0, 30.0, 11.0, 50.0, *w8a8[1:], 20.0, 16.0])
    monkeypatch.setattr(scale, "_w8a8_unfit", lambda: None if vnni else "no AVX-512 VNNI here")

    class FakeBench:
        def __init__(self, loaded, options, settings):
            self.name = {"auto": "int8", "w8a8": "w8a8"}.get(settings.quantize, settings.dtype)

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
    also = ["w8a8"] if vnni else []
    assert calls == ["bfloat16 warm", "int8 warm", *[f"{a} warm" for a in also]] + [
        "bfloat16", "bfloat16 stock", "int8", *also, "llama.cpp bf16 after 10", "llama.cpp Q8_0 after 10",
        "bfloat16", "bfloat16 stock", "int8", *also, "llama.cpp bf16 after 30", "llama.cpp Q8_0 after 30"]
    if vnni:
        assert [s.value for s in t.samples["cbgen w8a8, llama-1b"]] == [9.0, 8.0]
    assert [s.value for s in t.samples["cbgen bfloat16, llama-1b"]] == [10.0, 30.0]
    assert [s.value for s in t.samples["llama.cpp Q8_0, llama-1b"]] == [14.0, 16.0]
    assert tokens["cbgen bfloat16"] == pytest.approx(320 / 20.0) and tokens["llama.cpp Q8_0"] == pytest.approx(320 / 15)
    assert parameters == 1 and measured is timed
    assert Plan.of(True, "small").scale_rounds == 1


@pytest.mark.parametrize("vnni", [False, True])
def test_w8a8_rows_carry_no_goal_and_say_why_where_they_did_not_run(monkeypatch, vnni):
    """The issue's int8 is `--quantize int8` (the dequantized model's answers): w8a8 (other answers) gets figures
    beside it, against the float path and llama.cpp's Q8_0 (which quantizes its rows too), and no goal."""
    from types import SimpleNamespace

    from cbgen.bench import llamacpp, machine
    from cbgen.bench.suite import Timings
    from cbgen.bench.workloads import BenchWorkload, Measurement

    monkeypatch.setenv("CBGEN_CPU_KIND", "avx512-bf16")
    monkeypatch.setattr(scale, "_w8a8_unfit", lambda: None if vnni else "no AVX-512 VNNI here")
    monkeypatch.setattr(machine, "matmul_flops", lambda dtype: 1e9)
    monkeypatch.setattr(llamacpp, "bindings", lambda: (object(), None))
    t = Timings()
    took = {"cbgen bfloat16": 20.0, "cbgen bfloat16 stock": 22.0, "cbgen int8": 25.0, "llama.cpp bf16": 26.0,
            "llama.cpp Q8_0": 36.0} | ({"cbgen w8a8": 16.0} if vnni else {})
    for name, seconds in took.items():
        t.record(f"{name}, llama-1b", lambda s=seconds: Measurement("fixed", "x", s, 4, 256, 64))
    tokens = {name: 320 / s for name, s in took.items() if "stock" not in name}
    ctx = SimpleNamespace(plan=Plan.of(False, "small"), machine=SimpleNamespace(bf16_gflops=1.0))
    rows = {row.name: row for row in scale._rows(ctx, t, "llama-1b", tokens, 1, BenchWorkload("fixed", [[1] * 128] * 16,
                                                                                               64))}
    against_float, against_q8_0 = rows["cbgen w8a8 vs cbgen bfloat16, llama-1b"], rows[
        "cbgen w8a8 vs llama.cpp Q8_0, llama-1b"]
    assert against_float.goal is None and against_q8_0.goal is None
    if vnni:
        assert against_float.figure == pytest.approx(1.25) and against_q8_0.figure == pytest.approx(2.25)
    else:
        assert against_float.figure is None and "no AVX-512 VNNI" in against_float.note
    assert rows["cbgen int8 vs cbgen bfloat16, llama-1b"].goal is not None  # the int8 keeps its goal
