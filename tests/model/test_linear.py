"""cbgen.model.linear: each way of running the linear layers is installed for a block and leaves the model as it was
after it. The vocabulary projection in column chunks is bitwise the plain matmul, and is planned only where a probe
finds it so; --onednn-linear: float32 and bfloat16 linear layers through oneDNN's prepacked matmul give the stock
results to rounding, in float32 each row's result independent of how many rows share the matmul, and the same greedy
tokens through the engine as through model.generate; bfloat16 layers in row buckets run at a few row counts."""

from __future__ import annotations

import json

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

import cbgen.model.linear as linear
from cbgen.cli import run_cli
from cbgen.model.invariant import batch_invariant_linear
from cbgen.model.linear import LINEAR_KINDS, ONEDNN, ROW_BUCKETS, STOCK, TILES, VOCABULARY_CHUNKS, linear_layers


def tiny_llama(vocab_size: int = 500) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=vocab_size, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def _patched(model: torch.nn.Module) -> list[str]:
    """The modules that carry a forward of their own."""
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


def test_vocabulary_chunks_are_planned_exactly_where_bitwise_the_plain_projection():
    """Whether this machine's BLAS gives chunks bitwise the one matmul's depends on the CPU (yes on an AVX2 AMD
    EPYC, no on an Intel Xeon with AMX): chunks apply exactly where the model's own head, cut in chunks here, gives
    the one matmul's bits at the probed row counts, and the installed head then gives them at every row count."""
    model = tiny_llama(vocab_size=3 * linear.VOCAB_CHUNK + 123)  # a last chunk shorter than the others
    head = model.lm_head
    weight = head.weight.detach()
    with torch.no_grad():
        def cut(x: torch.Tensor) -> torch.Tensor:  # the head in chunks of VOCAB_CHUNK columns, written here
            rows = x.reshape(-1, x.shape[-1])
            return torch.cat([torch.mm(rows, weight[i : i + linear.VOCAB_CHUNK].t())
                              for i in range(0, weight.shape[0], linear.VOCAB_CHUNK)], dim=-1).view(*x.shape[:-1], -1)

        probes = [torch.randn(rows, 64) for rows in linear.PROBE_ROWS]
        same_here = all(torch.equal(cut(x), torch.nn.functional.linear(x, weight)) for x in probes)
        assert linear.vocabulary_chunks_apply(model) == same_here
        inputs = {rows: torch.randn(1, rows, 64) for rows in (1, 2, 64, linear.CHUNK_ROWS, 300)}
        plain = {rows: head(x) for rows, x in inputs.items()}
        with linear_layers(model, VOCABULARY_CHUNKS) as count:
            assert count == 1 and _patched(model) == ["lm_head"]
            chunked = {rows: head(x) for rows, x in inputs.items()}
        assert _patched(model) == []
    for rows in inputs:
        assert torch.equal(chunked[rows], cut(inputs[rows]) if rows <= linear.CHUNK_ROWS else plain[rows]), rows
        if same_here:
            assert torch.equal(chunked[rows], plain[rows]), rows


def test_vocabulary_chunks_are_not_planned_where_the_probe_finds_a_difference(monkeypatch):
    model = tiny_llama(vocab_size=3 * linear.VOCAB_CHUNK)
    chunked = linear._chunked
    monkeypatch.setattr(linear, "_chunked", lambda rows, weight: chunked(rows, weight) * (1 + 2**-20))
    linear.chunks_bitwise_same.cache_clear()
    try:
        assert not linear.vocabulary_chunks_apply(model)
    finally:
        linear.chunks_bitwise_same.cache_clear()
    assert not linear.vocabulary_chunks_apply(tiny_llama(vocab_size=500))  # too small a vocabulary to gain anything


def test_onednn_layers_match_stock_and_rows_do_not_depend_on_the_batch():
    model = tiny_llama()
    x = torch.randn(37, 64)
    layer = model.model.layers[0].mlp.gate_proj
    stock = layer(x)
    with torch.no_grad(), linear_layers(model, ONEDNN) as count:
        assert count == sum(type(m) is torch.nn.Linear for m in model.modules()) == 15
        ours = layer(x)
        assert torch.allclose(ours, stock, atol=1e-5)
        alone = [layer(x[i : i + 1]) for i in (0, 17, 36)]
        for row, single in zip((0, 17, 36), alone):
            assert torch.equal(single[0], ours[row])  # bitwise: the row's batch does not change it


def test_every_kind_puts_the_model_back_and_two_kinds_cannot_share_a_layer():
    """Outside the block the model computes bitwise what it computed before; a second kind on layers that already
    have a forward of their own (another engine's) is refused, and leaves the first one's in place."""
    model = tiny_llama(vocab_size=3 * linear.VOCAB_CHUNK)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(ids).logits
        for kind in (ONEDNN, VOCABULARY_CHUNKS, STOCK):
            with linear_layers(model, kind):
                assert torch.allclose(model(ids).logits, before, atol=1e-5)
            assert _patched(model) == [] and torch.equal(model(ids).logits, before)
        with linear_layers(model, ONEDNN):
            patched = _patched(model)
            with pytest.raises(RuntimeError, match="already have a forward of their own"), \
                    linear_layers(model, VOCABULARY_CHUNKS):
                pass
            with pytest.raises(RuntimeError, match="already have a forward of their own"), \
                    batch_invariant_linear(model):
                pass
            assert _patched(model) == patched
        assert _patched(model) == []
    with pytest.raises(ValueError, match="not a linear kind"), linear_layers(model, "fast"):
        pass


@pytest.mark.slow
def test_engine_gives_model_generate_tokens_with_onednn_linear():
    model = tiny_llama()
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(20, 60))]
    config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    # a small cache: transformers' default sizes (and zeroes) its tensors by the machine's free memory, which took
    # 90 % of this test's time for three prompts
    batching = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=128)
    with linear_layers(model, ONEDNN):
        batched = model.generate_batch(prompts, config, batching)
    by_prompt = {tuple(o.prompt_ids): o.generated_tokens for o in batched.values()}
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            alone = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert by_prompt[tuple(prompt)] == alone[0, len(prompt):].tolist()


def _linear_of_runs(tiny_model_dir, tmp_path, dtype: str, *flags: str) -> dict[str, str]:
    """What run.json says of the linear layers (and its engine scope), per flag; the model carries no forward of
    cbgen's after each run."""
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"input_ids": [7 + i, 8, 9, 10]}) + "\n" for i in range(4)))
    kinds = {}
    for flag in flags:
        out = tmp_path / f"out{dtype}{flag}"
        assert run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", dtype,
                        "--device", "cpu", "--max-new-tokens", "4", "-q", *([flag] if flag else [])]) == 0
        manifest = json.loads((out / "run.json").read_text())
        assert manifest["counts"]["succeeded"] == 4
        assert manifest["engine_scope"]["linear"] == manifest["model"]["linear"]
        kinds[flag] = manifest["model"]["linear"]
    return kinds


def test_runs_record_the_planned_linear_layers(tiny_model_dir, tmp_path):
    # by default a CPU job is batch-invariant (cbgen's compiled attention runs): fixed tiles; a linear kind asked for
    # by name wins over that default, and --no-batch-invariant gives the fastest stock kind of the dtype
    float32 = _linear_of_runs(tiny_model_dir, tmp_path, "float32", "", "--no-batch-invariant", "--onednn-linear")
    chunks = LINEAR_KINDS[VOCABULARY_CHUNKS] if linear.chunks_bitwise_same(len_vocab(tiny_model_dir), 64) \
        else LINEAR_KINDS[STOCK]
    assert float32 == {"": LINEAR_KINDS[TILES], "--no-batch-invariant": chunks, "--onednn-linear": LINEAR_KINDS[ONEDNN]}
    # oneDNN's bfloat16 linear needs AVX-512 BF16, AVX-NE-CONVERT or AVX-512 BW/VL/DQ: on an AVX2-only CPU it is
    # refused in one line (test_onednn_bfloat16_is_refused_where_the_cpu_cannot_run_it)
    packs = linear.onednn_unfit(torch.bfloat16) is None
    bfloat16 = _linear_of_runs(tiny_model_dir, tmp_path, "bfloat16", "", "--no-batch-invariant",
                               *(["--onednn-linear"] if packs else []), "--linear-row-buckets")
    assert bfloat16 == {"": LINEAR_KINDS[TILES], "--no-batch-invariant": LINEAR_KINDS[ROW_BUCKETS],
                        **({"--onednn-linear": LINEAR_KINDS[ONEDNN]} if packs else {}),
                        "--linear-row-buckets": LINEAR_KINDS[ROW_BUCKETS]}


def len_vocab(folder) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder).vocab_size


def test_prepacked_bfloat16_layers_give_the_stock_results_to_rounding():
    """Where oneDNN runs bfloat16 layers, they give the stock results to bf16 rounding; where this CPU cannot (AVX2
    only), every layer keeps the stock path: nothing is installed and the results are the stock ones, bit for bit."""
    model = tiny_llama().to(torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    layer = model.model.layers[0].mlp.gate_proj
    packs = linear.onednn_unfit(torch.bfloat16) is None
    with torch.no_grad():
        stock = [layer(x[:rows]) for rows in (1, 7, 64)]
        with linear_layers(model, ONEDNN) as count:
            assert count == (15 if packs else 0)
            ours = [layer(x[:rows]) for rows in (1, 7, 64)]
    for a, b in zip(stock, ours):
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-3) if packs else torch.equal(a, b)


def test_onednn_bfloat16_is_refused_where_the_cpu_cannot_run_it(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """--dtype bfloat16 --onednn-linear on a CPU whose oneDNN has no bf16 linear (AVX2 only) is one line, exit 2,
    before the weights load, not oneDNN's RuntimeError at the first layer (exit 3); what the probe says is this CPU's
    own answer."""
    source = tmp_path / "p.jsonl"
    source.write_text(json.dumps({"input_ids": [7, 8, 9]}) + "\n")
    unfit = linear.onednn_unfit(torch.bfloat16)
    if unfit is None:  # this CPU runs it: check the refusal with the answer an AVX2-only CPU's oneDNN gives
        unfit = ("oneDNN cannot run bfloat16 linear layers on this CPU (mkldnn_reorder_linear_weight: bf16 path "
                 "needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq)")
        monkeypatch.setattr(linear, "onednn_unfit", lambda dtype: unfit if dtype == torch.bfloat16 else None)
    from cbgen.model import load

    weights = load._load

    def structure_only(*args, **kwargs):  # the refusal comes before any weight is read
        assert args[3] is False, "the weights were loaded before the refusal"
        return weights(*args, **kwargs)

    monkeypatch.setattr(load, "_load", structure_only)
    code = run_cli(["run", str(source), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir), "--dtype",
                    "bfloat16", "--device", "cpu", "--onednn-linear", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.splitlines() == [f"Error: --onednn-linear: {unfit}; drop the flag (--dtype float32 runs it)"]


def test_onednn_linear_refuses_what_it_cannot_pack(tiny_model_dir, tmp_path, capsys):
    source = tmp_path / "p.jsonl"
    source.write_text(json.dumps({"input_ids": [7, 8, 9]}) + "\n")
    code = run_cli(["run", str(source), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir), "--dtype",
                    "float16", "--onednn-linear", "-q"])
    assert code != 0
    assert "--onednn-linear applies to float32 or bfloat16 on CPU" in capsys.readouterr().err


class _RowCounts(TorchFunctionMode):
    """Records the row count of every F.linear call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: set[int] = set()

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.rows.add(args[0].reshape(-1, args[0].shape[-1]).shape[0])
        return func(*args, **(kwargs or {}))


def test_bfloat16_linear_layers_run_at_a_few_row_counts_with_the_stock_results():
    """oneDNN builds (and keeps) a kernel per row count: bucketed, 1-300 rows make 17 matmul shapes, and every row
    keeps the stock result to bfloat16 rounding, at the shape it came in."""
    model = tiny_llama().to(torch.bfloat16)
    with linear_layers(tiny_llama(), ROW_BUCKETS) as count:
        assert count == 0  # float32: MKL, no such cache
    layer = model.model.layers[0].mlp.up_proj
    counts = _RowCounts()
    with torch.no_grad(), linear_layers(model, ROW_BUCKETS) as count:
        assert count == 15
        for rows in range(1, 301):
            x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
            stock = torch.nn.functional.linear(x, layer.weight)
            with counts:
                ours = layer(x)
            assert ours.shape == stock.shape == (1, rows, 160)
            torch.testing.assert_close(ours, stock)
    assert counts.rows == {8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320}


def test_row_buckets_asked_for_are_refused_where_they_do_not_apply(tiny_model_dir, tmp_path, capsys):
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"input_ids": [7 + i, 8, 9, 10]}) + "\n" for i in range(4)))
    base = ["run", str(source), "--model", str(tiny_model_dir), "--device", "cpu", "--max-new-tokens", "4", "-q"]
    assert run_cli([*base, "-o", str(tmp_path / "asked"), "--dtype", "float32", "--linear-row-buckets"]) == 2
    assert "--linear-row-buckets applies to bfloat16 or float16 on CPU" in capsys.readouterr().err
    assert run_cli([*base, "-o", str(tmp_path / "both"), "--linear-row-buckets", "--onednn-linear"]) == 2
    assert "use one" in capsys.readouterr().err
