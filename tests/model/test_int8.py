"""8-bit weights (cbgen/kernels/int8_linear.cpp, cbgen.model.int8): the kernel against float32 matmul of the same
int8 weights dequantized, over random shapes, on every instruction set the machine can run; a row's bits its own, and
the same in panels of either width; Q8_0's values recovered exactly from the gguf package's own dequantization; and a
job's greedy tokens against stock transformers running the dequantized weights."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cbgen.config.cpu import cpu_row
from cbgen.model import int8
from cbgen.model.invariant import probe_rows
from tests.helpers import NO_AMX, OTHER_ISAS, TWO_THREADS, property_examples, pytest_under_isa, torch_threads


@pytest.fixture(scope="module")
def ops():
    from cbgen.kernels import kernel

    built = kernel(int8.KERNEL)
    assert built.loaded, built.detail
    return torch.ops.cbgen_kernels


@st.composite
def layers(draw):
    in_features = 32 * draw(st.sampled_from([1, 8, 18, 64, 256]) | st.integers(1, 24))  # 256: row groups of 128
    count = draw(st.sampled_from([1, 63, 64, 65, 130]) | st.integers(1, 200))
    return dict(in_features=in_features, count=count, place=draw(st.integers(0, count - 1)),
                out_features=draw(st.sampled_from([1, 64, 65, 576]) | st.integers(1, 300)),
                bias=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                width=draw(st.sampled_from([64, 32])), seed=draw(st.integers(0, 2**16)))  # int8.block_n's widths


def _layer(case):
    """A case's random layer, quantized and packed in its width: (the generator, to draw rows from next, the float
    weight, the bias or None, int8 values, scales, packed values, packed scales)."""
    generator = torch.Generator().manual_seed(case["seed"])
    weight = torch.randn(case["out_features"], case["in_features"], generator=generator) * 0.05
    weight[0, :32] = 0  # a block of zeros: scale 0
    bias = torch.randn(case["out_features"], generator=generator) if case["bias"] else None
    q, scales = int8.quantize(weight)
    return (generator, weight, bias, q, scales, *int8.pack(q, scales, case["width"]))


@settings(max_examples=property_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
@example(dict(in_features=8192, count=300, place=200, out_features=130, bias=True, dtype=torch.float32, width=64,
              seed=1))
@example(dict(in_features=8192, count=300, place=200, out_features=130, bias=True, dtype=torch.float32, width=32,
              seed=1))
def test_the_kernel_is_the_dequantized_matmul_and_a_row_gets_its_own_bits(ops, case):
    generator, weight, bias, q, scales, packed, packed_scales = _layer(case)
    assert packed.shape == (-(-case["out_features"] // case["width"]), case["in_features"], case["width"])
    assert all(torch.equal(a, b) for a, b in zip(int8.unpack(packed, packed_scales, q.shape[0]), (q, scales),
                                                 strict=True))
    rows = probe_rows(weight, case["count"], generator).to(case["dtype"])
    with torch_threads(TWO_THREADS):
        together = ops.int8_linear(rows, packed, packed_scales, bias, case["out_features"])
    place = case["place"]
    alone = ops.int8_linear(rows[place : place + 1], packed, packed_scales, bias, case["out_features"])[0]
    assert together.dtype == case["dtype"] and torch.equal(together[place], alone)
    plain = torch.randn(case["count"], case["in_features"], generator=generator)
    result = ops.int8_linear(plain, packed, packed_scales, bias, case["out_features"])
    other = int8.pack(q, scales, {64: 32, 32: 64}[case["width"]])  # the other width: another loop on AVX2
    assert torch.equal(result, ops.int8_linear(plain, *other, bias, case["out_features"]))
    result = result.double()
    dequantized = int8.dequantize(q, scales).double()
    exact = torch.nn.functional.linear(plain.double(), dequantized, None if bias is None else bias.double())
    sizes = plain.double().abs() @ dequantized.abs().t() + (0 if bias is None else bias.double().abs())
    assert ((result - exact).abs() <= sizes * (case["in_features"] + 1) * 2**-24).all()


@settings(max_examples=property_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
@example(dict(in_features=8192, count=300, place=200, out_features=130, bias=True, dtype=torch.bfloat16, width=64,
              seed=1))
def test_bf16_rows_on_bf16_units_compute_the_bf16_rounded_weights_and_a_row_gets_its_own_bits(ops, case):
    """int8_linear_bf16 (bfloat16 rows on a CPU with bfloat16 units): the matmul of the int8 weights dequantized and
    rounded to bfloat16 (a bfloat16 model's weights), summed in float32, the output rounded once; a row's bits its
    own, in panels of either width; off AMX, bitwise the bfloat16 tiles' over those weights."""
    if not int8.bf16_arithmetic():
        pytest.skip("bfloat16 arithmetic needs a CPU with bfloat16 units (AMX or AVX-512 BF16)")
    generator, weight, bias, q, scales, packed, packed_scales = _layer(case)
    rows = probe_rows(weight, case["count"], generator).bfloat16()
    with torch_threads(TWO_THREADS):
        together = ops.int8_linear_bf16(rows, packed, packed_scales, bias, case["out_features"])
    place = case["place"]
    alone = ops.int8_linear_bf16(rows[place : place + 1], packed, packed_scales, bias, case["out_features"])[0]
    assert together.dtype == torch.bfloat16 and torch.equal(together[place], alone)
    other = int8.pack(q, scales, {64: 32, 32: 64}[case["width"]])
    assert torch.equal(together, ops.int8_linear_bf16(rows, *other, bias, case["out_features"]))
    if cpu_row().kind != "amx-bf16" and case["width"] == 64:  # the bfloat16 tiles' own bits, in the same chunks
        from cbgen.kernels import kernel

        assert kernel("linear_tiles").loaded
        tiles = ops.linear_pack(int8.dequantize(q, scales).bfloat16(), 64)
        assert torch.equal(together, ops.linear_tiles(rows, tiles, bias, case["out_features"]))
    weights = int8.dequantize(q, scales).bfloat16().double()
    exact = torch.nn.functional.linear(rows.double(), weights, None if bias is None else bias.double())
    sizes = rows.double().abs() @ weights.abs().t() + (0 if bias is None else bias.double().abs())
    error = (together.double() - exact).abs()
    assert (error <= exact.abs() * 2**-8 + sizes * (case["in_features"] + 1) * 2**-23).all()


class _Ops:
    """torch.ops.cbgen_kernels as an Int8Linear sees it, saying which op each call took."""

    def __init__(self) -> None:
        self.called: list[str] = []

    def __getattr__(self, name):
        def op(rows, packed, scales, bias, out_features):
            self.called.append(name)
            return torch.zeros(rows.shape[0], out_features, dtype=rows.dtype)

        return op


@pytest.mark.parametrize("units", [True, False])
def test_bf16_rows_take_the_bf16_kernel_only_where_the_cpu_has_bf16_units(monkeypatch, units):
    monkeypatch.setattr(int8, "bf16_arithmetic", lambda: units)
    ops = _Ops()
    q, scales = int8.quantize(torch.randn(8, 64))
    layer = int8.Int8Linear.of(q, scales, None, ops)
    layer(torch.randn(2, 3, 64))
    layer(torch.randn(2, 64).bfloat16())
    assert ops.called == ["int8_linear", "int8_linear_bf16" if units else "int8_linear"]
    # without the kernel: the weights the bfloat16 kernel would compute with, or the float32 ones
    layer.ops = None
    rows = torch.randn(3, 64).bfloat16()
    weights = int8.dequantize(q, scales)
    expected = torch.nn.functional.linear(rows.float(), weights.bfloat16().float() if units else weights)
    assert torch.equal(layer(rows), expected.bfloat16())


def test_the_values_of_a_q8_0_file_come_back_exactly():
    """What transformers loads from a Q8_0 GGUF (the gguf package's dequantization, in float32) quantized again by
    cbgen gives the file's own int8 values and float16 scales."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((96, 256)) * rng.uniform(0.001, 3, (96, 1))).astype(np.float32)
    weight[3, 32:64] = 0
    raw = quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)  # 34 bytes a block: float16 scale, 32 int8
    loaded = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).copy())
    q, scales = int8.quantize(loaded)
    blocks = raw.reshape(96, -1, 34)
    assert np.array_equal(q.numpy().reshape(96, -1, 32), blocks[..., 2:].view(np.int8))
    assert np.array_equal(scales.numpy(), blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0])
    assert torch.equal(int8.dequantize(q, scales), loaded)


def test_a_gguf_files_weight_type_is_read_once(tmp_path, monkeypatch):
    import gguf
    from gguf import quants

    def write(path, kind):
        writer = gguf.GGUFWriter(str(path), "llama")
        data = np.ones((4, 64), dtype=np.float32)
        if kind == "q8_0":
            writer.add_tensor("blk.0.attn_q.weight", quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor("blk.0.attn_q.weight", data)
        writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write(tmp_path / "q.gguf", "q8_0")
    write(tmp_path / "f.gguf", "f32")
    memo = tmp_path / "digests.json"
    assert int8.gguf_is_q8_0(tmp_path / "q.gguf", memo) and not int8.gguf_is_q8_0(tmp_path / "f.gguf", memo)
    assert {entry["q8_0"] for entry in json.loads(memo.read_text()).values()} == {True, False}

    def unread(*args, **kwargs):
        raise AssertionError("read again")

    monkeypatch.setattr(gguf, "GGUFReader", unread)
    assert int8.gguf_is_q8_0(tmp_path / "q.gguf", memo)  # kept: not parsed again
    os.utime(tmp_path / "q.gguf", ns=(1, 1))  # a file changed in place is read again
    with pytest.raises(AssertionError, match="read again"):
        int8.gguf_is_q8_0(tmp_path / "q.gguf", memo)


def _dequantized_in_place(model) -> None:
    """The reference: each decoder-layer weight replaced by its int8 values dequantized, in float32."""
    for layer in model.model.layers:
        for module in layer.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(int8.dequantize(*int8.quantize(module.weight)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_models_layers_become_int8_and_compute_the_dequantized_model(ops, tiny_model_dir, dtype):
    """In float32 to float32's rounding; in bfloat16 (the kernel's bfloat16 path on a CPU with bfloat16 units, else
    float32 arithmetic) within a few bfloat16 steps of the logits' size of the dequantized model run in bfloat16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    done = int8.quantize_model(model)
    # a byte a weight and a float16 scale per 32 (and the last panel's padding), against 4 or 2 bytes
    assert done.layers == 2 * 7 and done.kernel == "compiled"
    assert done.bytes_after < done.bytes_before * 1.2 / dtype.itemsize
    with torch.no_grad():
        _dequantized_in_place(reference)
        reference = reference.to(dtype)
        ids = torch.randint(0, 1000, (3, 20), generator=torch.Generator().manual_seed(0))
        logits, expected = model(ids).logits.float(), reference(ids).logits.float()
        tolerance = 1e-4 if dtype == torch.float32 else 4 * 2**-8 * expected.abs().max().item()
        torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)
    assert not any(type(m) is torch.nn.Linear for layer in model.model.layers for m in layer.modules())


def test_int8_with_adapters_or_tp_or_a_gpu_is_refused_in_one_line():
    assert "--quantize w8a8 with --adapter" in int8.refusal("w8a8", True, 1, "cpu")
    assert "--adapter" in int8.refusal("int8", True, 1, "cpu")
    assert "--tp" in int8.refusal("int8", False, 2, "cpu")
    assert "GPU" in int8.refusal("int8", False, 1, "cuda")
    assert int8.refusal("int8", False, 1, "cpu") is None and int8.refusal("none", True, 2, "cuda") is None


@pytest.mark.slow
@pytest.mark.parametrize("isa", [*OTHER_ISAS, "avx512-bf16-no-amx"])
def test_the_kernel_holds_on_other_instruction_sets(isa, monkeypatch):
    # an AMX machine held to AVX-512 BF16 runs the bf16 path's pair layout and compares it with the bf16 tiles
    selection = "the_kernel_is_the_dequantized_matmul or bf16_rows_on_bf16_units or w8a8_is_the_matmul"
    if isa not in OTHER_ISAS:
        monkeypatch.setitem(OTHER_ISAS, isa, NO_AMX)
        selection = "bf16_rows_on_bf16_units"
    pytest_under_isa(isa, __file__, selection, examples=25)


def _job_tokens(out) -> dict[str, list[int]]:
    from cbgen.rows import read_shards

    return {str(row["id"]): row["token_ids"] for row in read_shards(out)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int8_job_answers_as_the_dequantized_model_and_is_batch_invariant(tiny_model_dir, tmp_path, dtype):
    """Greedy tokens of a --quantize int8 job against the float32 model whose weights are the same int8 values
    dequantized (cbgen's float32 path is stock transformers' greedy: tests/test_greedy_temperature.py and the
    architecture tests): the first 32 tokens of at least 95 % of rows equal (the rest is rounding: the kernel adds
    in chunks, torch in its own order). And the int8 job is batch-invariant: the same rows shuffled, under other
    batch limits, give bitwise the same tokens. In bfloat16 on a CPU with bfloat16 units (the kernel's bfloat16 path)
    the same against that model run in bfloat16."""
    import random

    if dtype == "bfloat16" and not int8.bf16_arithmetic():
        pytest.skip("bfloat16 arithmetic needs a CPU with bfloat16 units (AMX or AVX-512 BF16)")

    from transformers import AutoModelForCausalLM

    from cbgen.cli import run_cli
    from tests.helpers import write_jsonl

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        _dequantized_in_place(model)
    dequantized = tmp_path / "dequantized"
    model.save_pretrained(dequantized)
    for file in tiny_model_dir.iterdir():  # the tokenizer, its chat template, the generation config
        if not (dequantized / file.name).exists():
            (dequantized / file.name).write_bytes(file.read_bytes())
    rows = [{"id": str(i), "prompt": f"Tell me about the number {i} and the colour {c}."}
            for i, c in zip(range(24), ["red", "green", "blue", "amber"] * 6, strict=True)]
    source = write_jsonl(tmp_path / "p.jsonl", rows)
    common = ["--max-new-tokens", "32", "--dtype", dtype, "-q"]
    assert run_cli(["run", str(source), "-o", str(tmp_path / "ref"), "--model", str(dequantized), *common]) == 0
    assert run_cli(["run", str(source), "-o", str(tmp_path / "q"), "--model", str(tiny_model_dir), "--quantize",
                    "int8", *common]) == 0
    reference, quantized = _job_tokens(tmp_path / "ref"), _job_tokens(tmp_path / "q")
    same = sum(quantized[key][:32] == reference[key][:32] for key in reference)
    assert same >= 0.95 * len(reference), f"{same} of {len(reference)} rows"
    manifest = json.loads((tmp_path / "q" / "run.json").read_text())
    assert manifest["model"]["quantized"]["layers"] == 14 and manifest["model"]["quantized"]["kernel"] == "compiled"
    assert manifest["batch_invariant"]["on"] is True
    random.Random(1).shuffle(rows)
    shuffled = write_jsonl(tmp_path / "shuffled.jsonl", rows)
    assert run_cli(["run", str(shuffled), "-o", str(tmp_path / "q2"), "--model", str(tiny_model_dir), "--quantize",
                    "int8", "--max-requests-per-batch", "3", "--max-batch-tokens", "40", *common]) == 0
    assert _job_tokens(tmp_path / "q2") == quantized


def test_a_job_with_int8_and_adapters_stops_before_loading(tiny_model_dir, lora_adapters, tmp_path, capsys):
    from cbgen.cli import run_cli
    from tests.helpers import write_jsonl

    source = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hi"}])
    adapter = next(iter(lora_adapters.values()))
    code = run_cli(["run", str(source), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir), "--quantize",
                    "int8", "--adapter", str(adapter), "-q"])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "--quantize int8 with --adapter" in err


@pytest.mark.parametrize(("capability", "width"), [("AVX2", 32), ("AVX512", 64)])
def test_int8_layers_are_packed_in_the_float32_tiles_width(ops, tiny_model_dir, monkeypatch, capability, width):
    """The int8 kernel's arithmetic is the float32 tiles' (oneDNN's float32 micro-kernel), so its panels take their
    width, decided in one place (cbgen.model.tiles_kernel.block_n): 32 columns under AVX2 kernels, 64 elsewhere. A
    quantized model's layers are packed so and compute the dequantized model; keys and values of 32 outputs are whole
    panels at 32 columns (the decoder layers fuse) and not at 64 (the stock layers run, and the reason says so)."""
    from transformers import AutoModelForCausalLM

    from cbgen.model import fused

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert int8.block_n() == width
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    int8.quantize_model(model)
    layers = [m for m in model.modules() if isinstance(m, int8.Int8Linear)]
    assert layers and {m.width for m in layers} == {width}
    assert {m.out_features for m in layers} >= {32}  # the tiny model's keys and values
    assert (fused.unfit_reason(model) is None) == (width == 32)
    if width == 64:
        assert "not whole panels" in (fused.unfit_reason(model) or "")
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _dequantized_in_place(reference)
        expected = reference(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
        if width == 32:  # fused (the caller asks unfit_reason first)
            with fused.fused_layers(model):
                torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_int8_decoder_layers_fuse_with_their_panels_shared(ops, tiny_model_dir):
    """cbgen's fused decoder layers merge int8 projections panel by panel: the merged layer computes what its parts
    do, each part's panels become views of the merged ones (no second copy), and they own their panels again once
    separated; layers in panels of different widths are never merged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cbgen.model import fused

    parts = [int8.Int8Linear(*int8.pack(*int8.quantize(torch.randn(64, 64)), width), None, 64, ops)
             for width in (64, 32)]
    assert not int8.Int8Linear.mergeable(parts) and int8.Int8Linear.mergeable(parts[:1] * 2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    int8.quantize_model(model)
    assert fused.unfit_reason(model) is None
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alone = model(ids).logits
        with fused.fused_layers(model) as merged:
            together = model(ids).logits
            assert merged.linears == ()  # no nn.Linear for the engine's linear kind to take over
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    attn = model.model.layers[0].self_attn
    qkv, _ = fused._merges[model.model.layers[0]]
    assert qkv.views_of([attn.q_proj, attn.k_proj, attn.v_proj])
    assert attn.k_proj.packed.data_ptr() == qkv.packed[attn.q_proj.packed.shape[0]:].data_ptr()
    fused.separate(model)
    assert attn.q_proj.packed.data_ptr() != qkv.packed.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, alone, rtol=0, atol=0)


def test_panels_side_by_side_in_one_storage_merge_as_a_view_and_others_as_a_copy():
    whole = torch.arange(5 * 4 * 2, dtype=torch.int8).view(5, 4, 2)
    first, second = whole[:2], whole[2:]
    merged = int8._side_by_side([first, second])
    assert merged.data_ptr() == whole.data_ptr() and torch.equal(merged, whole)
    apart = int8._side_by_side([whole[:2], whole[3:]])  # a gap between them
    assert apart.data_ptr() != whole.data_ptr() and torch.equal(apart, torch.cat([whole[:2], whole[3:]]))
    swapped = int8._side_by_side([second, first])
    assert swapped.data_ptr() != whole.data_ptr() and torch.equal(swapped, torch.cat([second, first]))


@settings(max_examples=property_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
@example(dict(in_features=8192, count=300, place=200, out_features=130, bias=True, dtype=torch.bfloat16, width=64,
              seed=1))
def test_w8a8_is_the_matmul_of_the_quantized_rows_and_a_row_gets_its_own_bits(ops, case):
    """int8_linear_w8a8 (`--quantize w8a8`): the rows quantized as int8.quantize_rows says, times the int8 weights,
    to float32's rounding of each group's scale product and sum; a row's bits its own; and the same bits from the
    VPDPBUSD loop (64-column panels, where the CPU has AVX-512 VNNI) and the plain loop (32-column panels)."""
    generator, weight, bias, q, scales, packed, packed_scales = _layer(case)
    rows = probe_rows(weight, case["count"], generator).to(case["dtype"])
    rows[0, :32] = 0  # a group of zeros, one of tiny values and one past float16's range
    rows[-1, -32:] = 1e-30
    rows[-1, :32] = 1e7
    with torch_threads(TWO_THREADS):
        together = ops.int8_linear_w8a8(rows, packed, packed_scales, bias, case["out_features"])
    place = case["place"]
    alone = ops.int8_linear_w8a8(rows[place : place + 1], packed, packed_scales, bias, case["out_features"])[0]
    assert together.dtype == case["dtype"] and torch.equal(together[place], alone)
    other = int8.pack(q, scales, {64: 32, 32: 64}[case["width"]])
    assert torch.equal(together, ops.int8_linear_w8a8(rows, *other, bias, case["out_features"]))
    for width_64 in (packed, other[0]):  # panels arranged once for VPDPBUSD: the same bits
        if width_64.shape[2] == 64 and ops.int8_w8a8_vnni(64):
            arranged = width_64.clone()
            ops.int8_w8a8_arrange_(arranged)
            scales_64 = packed_scales if width_64 is packed else other[1]
            assert torch.equal(together, ops.int8_linear_w8a8(rows, arranged, scales_64, bias, case["out_features"],
                                                               True))
    quantized, dequantized = int8.quantize_rows(rows).double(), int8.dequantize(q, scales).double()
    exact = torch.nn.functional.linear(quantized, dequantized, None if bias is None else bias.double())
    sizes = quantized.abs() @ dequantized.abs().t() + (0 if bias is None else bias.double().abs())
    rounding = 2**-8 if case["dtype"] == torch.bfloat16 else 2**-24  # the output's own
    error = (together.double() - exact).abs()
    assert (error <= exact.abs() * rounding + sizes * (case["in_features"] // 32 + 2) * 2**-23).all()


def test_quantized_rows_are_q8_0s_arithmetic():
    """Each 32 inputs over their largest magnitude / 127, rounded to nearest even, within +-127."""
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5, 1.5] + [0.0] * 27 + [0.0] * 32])
    assert int8.quantize_rows(x)[0, :5].tolist() == [127.0, 2.0, -4.0, 0.0, 2.0]
    assert int8.quantize_rows(x)[0, 32:].abs().sum() == 0
    sizes = torch.tensor([1e-3, 1.0, 1e4]).repeat_interleave(32)  # one group of each
    y = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * sizes
    scales = y.reshape(5, 3, 32).abs().amax(-1, keepdim=True) / 127
    error = (int8.quantize_rows(y) - y).reshape(5, 3, 32).abs()
    assert (error <= scales * (0.5 + 1e-5)).all()


def test_a_w8a8_job_answers_as_the_dequantized_model_on_quantized_rows_and_is_batch_invariant(tiny_model_dir,
                                                                                               tmp_path):
    """`--quantize w8a8`: greedy tokens against stock transformers running the dequantized weights with each
    quantized layer's input rows put through int8.quantize_rows (the first 32 tokens of at least 95 % of rows equal;
    the rest is the sums' order), batch-invariant (the rows shuffled, under other batch limits: bitwise the same
    tokens), and its arithmetic in run.json."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cbgen.cli import run_cli
    from tests.helpers import write_jsonl

    rows = [{"id": str(i), "prompt": f"Tell me about the number {i} and the colour {c}."}
            for i, c in zip(range(24), ["red", "green", "blue", "amber"] * 6, strict=True)]
    source = write_jsonl(tmp_path / "p.jsonl", rows)
    common = ["--max-new-tokens", "32", "--dtype", "float32", "-q", "--model", str(tiny_model_dir), "--quantize",
              "w8a8"]
    assert run_cli(["run", str(source), "-o", str(tmp_path / "q"), *common]) == 0
    quantized = _job_tokens(tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / "run.json").read_text())
    assert manifest["model"]["quantized"]["arithmetic"] == "w8a8"
    how = manifest["model"]["quantized"]["w8a8"]
    assert how.startswith("compiled")
    if torch.ops.cbgen_kernels.int8_w8a8_vnni(int8.block_n()):
        assert "14 of 14 layers arranged" in how

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        _dequantized_in_place(model)
    for layer in model.model.layers:
        for module in layer.modules():
            if type(module) is torch.nn.Linear:
                module.register_forward_pre_hook(lambda _, args: (int8.quantize_rows(args[0]),))
    same = 0
    for row in rows:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        reference = out[0, ids.shape[1]:].tolist()
        same += quantized[row["id"]][:32] == reference[:32]
    assert same >= 0.95 * len(rows), f"{same} of {len(rows)} rows"

    random.Random(1).shuffle(rows)
    shuffled = write_jsonl(tmp_path / "shuffled.jsonl", rows)
    assert run_cli(["run", str(shuffled), "-o", str(tmp_path / "q2"), *common, "--max-requests-per-batch", "3",
                    "--max-batch-tokens", "40"]) == 0
    assert _job_tokens(tmp_path / "q2") == quantized


def test_w8a8_runs_integer_products_where_the_cpu_has_vnni_and_not_when_held_below_it(ops):
    """VPDPBUSD runs where the CPU has AVX-512 VNNI and the build is AVX-512 (64-column panels); a machine held to
    AVX-512 without VNNI (cbgen.config.cpu.HOLDS["avx512"], as a Skylake-X) runs the plain loop, as that one would."""
    import subprocess
    import sys

    from cbgen.config.cpu import HOLDS, cpu_flags

    held = os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX512_CORE"
    own = "avx512_vnni" in cpu_flags() and int8.block_n() == 64 and not held
    assert bool(ops.int8_w8a8_vnni(64)) == own and not ops.int8_w8a8_vnni(32)
    if "avx512f" in cpu_flags():
        code = ("import torch; from cbgen.kernels import kernel; kernel('int8_linear'); "
                "print(torch.ops.cbgen_kernels.int8_w8a8_vnni(64))")
        done = subprocess.run([sys.executable, "-c", code], env=os.environ | HOLDS["avx512"], capture_output=True,
                              text=True, timeout=300)
        assert done.stdout.strip().splitlines()[-1] == "False", done.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_w8a8_layer_without_the_kernel_computes_the_quantized_rows_eagerly(ops, dtype):
    """Where the kernel did not build, a w8a8 layer's rows are quantized by quantize_rows and multiplied by the
    dequantized weights in float32 (never rounded to bfloat16 first, as int8's bf16 path is): the kernel's values to
    its sums' order."""
    generator = torch.Generator().manual_seed(3)
    q, scales = int8.quantize(torch.randn(100, 96, generator=generator) * 0.05)
    bias = torch.randn(100, generator=generator)
    eager, compiled = int8.Int8Linear.of(q, scales, bias, None), int8.Int8Linear.of(q, scales, bias, ops)
    eager.w8a8 = compiled.w8a8 = True
    x = torch.randn(2, 5, 96, generator=generator).to(dtype)
    expected = torch.nn.functional.linear(int8.quantize_rows(x), int8.dequantize(q, scales), bias).to(dtype)
    assert torch.equal(eager(x), expected)
    torch.testing.assert_close(eager(x), compiled(x), rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
