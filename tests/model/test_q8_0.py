"""A Q8_0 GGUF file read straight into int8 layers (cbgen.model.q8_0): the embedding lookup from int8 panels, the
rows transformers reorders landing where its own loader puts them, a file's every int8 value against transformers'
dequantized load of it, no float matrix held, the fallback for files that cannot be read so, and a job's greedy tokens
against the dequantized model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.model import int8, q8_0
from tests.helpers import property_examples


@settings(max_examples=property_examples(30), deadline=None)
@given(vocab=st.integers(1, 300), hidden=st.integers(1, 6).map(lambda n: 32 * n), ids=st.lists(st.integers(0, 10**6),
                                                                                               min_size=1, max_size=40),
       seed=st.integers(0, 2**16), width=st.sampled_from([64, 32]))
def test_an_int8_embedding_looks_up_the_dequantized_rows(vocab, hidden, ids, seed, width):
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))
    q, scales = int8.quantize(weight)
    table = int8.Int8Linear(*int8.pack(q, scales, width), None, vocab, None)  # panels of either of int8.block_n's
    flat = torch.tensor([i % vocab for i in ids])
    index = flat.view(-1, 1) if len(ids) % 2 else flat  # ids of any shape
    looked_up = q8_0.Int8Embedding(table)(index)
    assert looked_up.shape == (*index.shape, hidden)
    assert torch.equal(looked_up, torch.nn.functional.embedding(index, int8.dequantize(q, scales)))


@settings(max_examples=property_examples(30), deadline=None)
@given(kv_heads=st.integers(1, 4), group=st.integers(1, 4), half_dim=st.integers(1, 8), columns=st.integers(1, 5))
def test_the_rows_transformers_reorders_are_reordered_alike(kv_heads, group, half_dim, columns):
    """The row order read off transformers' Llama processor (applied to row indices) puts every row of a matrix
    where the processor applied to the matrix itself puts it: queries and keys (reordered), values (not)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads = kv_heads * group
    config = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    processor = LlamaTensorProcessor(config=config)
    for name, count in (("blk.0.attn_q.weight", heads), ("blk.0.attn_k.weight", kv_heads),
                        ("blk.0.attn_v.weight", kv_heads)):
        rows = count * 2 * half_dim
        matrix = np.random.default_rng(rows).standard_normal((rows, columns)).astype(np.float32)
        expected = processor.process(weights=matrix, name=name).weights
        order = q8_0._row_order(processor, name, rows)
        assert (order is None) == (name == "blk.0.attn_v.weight" or half_dim == 1)  # else rows move
        assert np.array_equal(matrix if order is None else matrix[order.numpy()], expected)


@pytest.fixture(scope="module")
def q8_0_file(tmp_path_factory):
    from cbgen.model.source import embedded_model_path
    from tests.helpers import q8_0_copy

    return q8_0_copy(embedded_model_path(), tmp_path_factory.mktemp("q8_0") / "smollm2-q8_0.gguf")


@pytest.mark.embedded
def test_a_q8_0_file_is_read_as_its_own_int8_values_and_no_float_matrix(q8_0_file):
    """A Q8_0 GGUF (the embedded model's matrices requantized by the gguf package) loads as int8 by default, read
    from the file as it is: every int8 layer's values, dequantized, are bitwise the float32 weights transformers'
    loader reads from the file (--quantize none), including the rows it reorders for Llama's attention; the
    embedding table is int8 too and serves the tied output layer; no float matrix is held; the logits are the
    dequantized model's up to rounding."""
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    quantized = load_model(ModelSection(model=str(q8_0_file), dtype="float32", use_cache=False))
    dequantized = load_model(ModelSection(model=str(q8_0_file), quantize="none", dtype="float32", use_cache=False))
    summary = quantized.quantized
    assert summary is not None and dequantized.quantized is None
    assert summary["loader"] == "read as int8 from the file" and summary["embeddings"] == "int8"
    assert summary["layers"] == 30 * 7 + 1 and summary["weight_bytes_after"] < summary["weight_bytes_before"] / 3
    model = quantized.model
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, q8_0.Int8Embedding) and model.get_output_embeddings() is embeddings.table
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, int8.Int8Linear)]
    assert len(layers) == 30 * 7 + 1 and {m.width for _, m in layers} == {int8.block_n()}
    for name, module in layers:
        reference = dequantized.model.get_input_embeddings() if name.endswith(".table") else \
            dequantized.model.get_submodule(name)
        assert torch.equal(int8.dequantize(*int8.unpack(module.packed, module.packed_scales, module.out_features)),
                           reference.weight), name
    assert all(p.dim() == 1 for p in model.parameters()), "a float matrix is held"
    assert len({m.packed.untyped_storage().data_ptr() for _, m in layers}) == 1  # the panels are one allocation
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dequantized.model(ids).logits, rtol=1e-3, atol=1e-3)


@pytest.mark.embedded
def test_a_q8_0_model_asked_for_in_bfloat16_is_bfloat16_around_its_int8_layers(q8_0_file):
    """Int8 values are read in float32 (exact); a job asked for bfloat16 then holds the rest of the model in bfloat16
    (norms; the int8 embedding table answers in bfloat16) while the int8 layers keep their float16 scales, and its
    logits are about as near the dequantized model's float32 logits as that model's own in bfloat16 (on average
    within twice their distance: bfloat16 rounding over 30 layers, whichever arithmetic the int8 kernel uses on this
    CPU; a position or two amplify rounding, so the largest difference says little: 10.1 against 4.3 on a Zen 4,
    where the means were 0.39 against 0.29)."""
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    quantized = load_model(ModelSection(model=str(q8_0_file), dtype="bfloat16", use_cache=False))
    dequantized = load_model(ModelSection(model=str(q8_0_file), quantize="none", dtype="bfloat16", use_cache=False))
    model = quantized.model
    assert quantized.dtype == torch.bfloat16 and model.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    layers = [m for m in model.modules() if isinstance(m, int8.Int8Linear)]
    assert {m.packed_scales.dtype for m in layers} == {torch.float16}
    assert {m.packed.dtype for m in layers} == {torch.int8}
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    assert model.get_input_embeddings()(ids).dtype == torch.bfloat16
    exact = load_model(ModelSection(model=str(q8_0_file), quantize="none", dtype="float32", use_cache=False))
    with torch.no_grad():
        logits, reference = model(ids).logits.float(), exact.model(ids).logits
        bfloat16 = (dequantized.model(ids).logits.float() - reference).abs().mean()
    assert 0 < (logits - reference).abs().mean() <= 2 * bfloat16


@pytest.mark.embedded
def test_a_q8_0_models_fused_projections_are_views_of_its_panels(q8_0_file):
    """The fused decoder layers' merged projections of a model read from a Q8_0 file are views of the panels as they
    were read (laid out side by side in the model's order), not copies; they compute what the parts do."""
    from cbgen.config import ModelSection
    from cbgen.model import fused
    from cbgen.model.load import load_model

    model = load_model(ModelSection(model=str(q8_0_file), use_cache=False)).model
    attn = model.model.layers[3].self_attn
    ids = torch.randint(0, 49152, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = model(ids).logits
        with fused.fused_layers(model):
            qkv, gate_up = fused._merges[model.model.layers[3]]
            together = model(ids).logits
    assert qkv.packed.data_ptr() == attn.q_proj.packed.data_ptr() and qkv.views_of([attn.q_proj, attn.k_proj,
                                                                                     attn.v_proj])
    assert gate_up.packed_scales.data_ptr() == model.model.layers[3].mlp.gate_proj.packed_scales.data_ptr()
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.embedded
def test_a_file_that_cannot_be_read_as_int8_loads_dequantized_and_says_why(q8_0_file, monkeypatch):
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    def unfit(*args, **kwargs):
        raise q8_0.Unfit("the 'llama' architecture's tensors are rearranged as they load")

    monkeypatch.setattr(q8_0, "_processor", unfit)
    loaded = load_model(ModelSection(model=str(q8_0_file), use_cache=False))
    assert loaded.quantized is not None and loaded.quantized["layers"] == 30 * 7
    assert loaded.quantized["loader"] == ("dequantized by transformers, quantized again (the 'llama' architecture's "
                                          "tensors are rearranged as they load)")
    assert loaded.quantized["embeddings"] == "float"


@pytest.mark.embedded
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_q8_0_job_answers_as_the_dequantized_model(q8_0_file, tmp_path, dtype):
    """Greedy tokens of a job on the Q8_0 file (int8, read directly) against the same file dequantized to float32
    (stock transformers' arithmetic): the first 32 tokens of at least 95 % of rows equal. In bfloat16 on a CPU with
    bfloat16 units (the int8 kernel's bfloat16 path), against the dequantized file run in bfloat16."""
    from cbgen.cli import run_cli
    from cbgen.rows import read_shards
    from tests.helpers import write_jsonl

    if dtype == "bfloat16" and not int8.bf16_arithmetic():
        pytest.skip("bfloat16 arithmetic needs a CPU with bfloat16 units (AMX or AVX-512 BF16)")
    rows = [{"id": str(i), "prompt": f"Name {i} fruits and one colour."} for i in range(10)]
    source = write_jsonl(tmp_path / "p.jsonl", rows)
    common = ["--max-new-tokens", "32", "-q", "--model", str(q8_0_file), "--no-model-cache", "--dtype", dtype]
    assert run_cli(["run", str(source), "-o", str(tmp_path / "q"), *common]) == 0
    assert run_cli(["run", str(source), "-o", str(tmp_path / "ref"), "--quantize", "none", *common]) == 0
    tokens = {kind: {str(r["id"]): r["token_ids"][:32] for r in read_shards(tmp_path / kind)} for kind in ("q", "ref")}
    same = sum(tokens["q"][key] == tokens["ref"][key] for key in tokens["ref"])
    assert same >= 0.95 * len(rows), f"{same} of {len(rows)} rows"
    manifest = json.loads((tmp_path / "q" / "run.json").read_text())
    assert manifest["model"]["quantized"]["loader"] == "read as int8 from the file"


@pytest.mark.embedded
def test_a_q8_0_file_in_w8a8_arranges_its_layers_but_not_the_table_the_embedding_reads(q8_0_file):
    """`--quantize w8a8` on a Q8_0 file: the decoder layers' panels are arranged for VPDPBUSD in place at load (where
    the kernel has it), the tied output layer's are not (the int8 embedding table looks rows up in them, and its
    lookups stay the file's rows), and the logits are near those of the same model computing its layers on rows
    quantized by int8.quantize_rows (not to rounding: a last-bit difference can move a value across a rounding step
    of the next layer's quantization: the reference's own logits move by 1 % on average for inputs 1e-6 apart)."""
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    w8a8 = load_model(ModelSection(model=str(q8_0_file), dtype="float32", quantize="w8a8", use_cache=False))
    plain = load_model(ModelSection(model=str(q8_0_file), dtype="float32", use_cache=False))
    assert w8a8.quantized is not None and w8a8.quantized["arithmetic"] == "w8a8"
    model = w8a8.model
    head = model.get_output_embeddings()
    layers = [m for m in model.modules() if isinstance(m, int8.Int8Linear)]
    assert all(m.w8a8 for m in layers) and not head.arranged
    vnni = torch.ops.cbgen_kernels.int8_w8a8_vnni(int8.block_n())
    assert all(m.arranged == vnni for m in layers if m is not head)
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.get_input_embeddings()(ids), plain.model.get_input_embeddings()(ids))
    for m in plain.model.modules():
        if isinstance(m, int8.Int8Linear):
            m.register_forward_pre_hook(lambda _, args: (int8.quantize_rows(args[0]),))
    with torch.no_grad():
        ours, reference = model(ids).logits, plain.model(ids).logits
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    assert (ours - reference).abs().mean() <= 0.02 * reference.abs().mean()
