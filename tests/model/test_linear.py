"""cbgen.model.linear: the vocabulary projection in column chunks is bitwise the plain matmul, and is switched on only
where a probe finds it so; --onednn-linear: float32 and bfloat16 linear layers through oneDNN's prepacked matmul
give the stock results to rounding, in float32 each row's result independent of how many rows share the matmul,
and the same greedy tokens through the engine as through model.generate."""

from __future__ import annotations

import json

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import cbgen.model.linear as linear
from cbgen.cli import run_cli
from cbgen.model.invariant import batch_invariant_linear
from cbgen.model.linear import (
    bucket_linear_rows,
    chunk_vocab_projection,
    linear_kind,
    onednn_linear,
    use_onednn_linear,
    uses_onednn_linear,
)


def tiny_llama(vocab_size: int = 500) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=vocab_size, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def test_vocabulary_chunks_are_on_exactly_where_bitwise_the_plain_projection():
    """Whether this machine's BLAS gives chunks bitwise the one matmul's depends on the CPU (yes on an AVX2 AMD
    EPYC, no on an Intel Xeon with AMX): chunks are on exactly where the probe finds them equal, and then equal."""
    model = tiny_llama(vocab_size=3 * linear.VOCAB_CHUNK + 123)  # a last chunk shorter than the others
    head = model.lm_head
    inputs = {rows: torch.randn(1, rows, 64) for rows in (1, 2, 64, linear.CHUNK_ROWS, 300)}
    with torch.no_grad():
        plain = {rows: head(x) for rows, x in inputs.items()}
        assert linear_kind(model) == "stock"
        equal = linear._bitwise_same(head.weight)
        assert chunk_vocab_projection(model) == equal
        chunked = f"stock, vocabulary in {linear.VOCAB_CHUNK}-column chunks"
        assert linear_kind(model) == (chunked if equal else "stock")
        assert ("forward" in vars(head)) == equal
        for rows, x in inputs.items():
            assert torch.equal(head(x), plain[rows])


def test_vocabulary_chunks_stay_off_where_the_probe_finds_a_difference(monkeypatch):
    model = tiny_llama(vocab_size=3 * linear.VOCAB_CHUNK)
    chunked = linear._chunked
    monkeypatch.setattr(linear, "_chunked", lambda rows, weight: chunked(rows, weight) * (1 + 2**-20))
    assert not chunk_vocab_projection(model)
    assert linear_kind(model) == "stock" and "forward" not in vars(model.lm_head)
    assert not chunk_vocab_projection(tiny_llama(vocab_size=500))  # too small a vocabulary to gain anything


def test_linear_layers_match_stock_and_rows_do_not_depend_on_the_batch():
    model = tiny_llama()
    x = torch.randn(37, 64)
    stock = model.model.layers[0].mlp.gate_proj(x)
    assert use_onednn_linear(model) == sum(type(m) is torch.nn.Linear for m in model.modules()) == 15
    with torch.no_grad():
        ours = model.model.layers[0].mlp.gate_proj(x)
        assert torch.allclose(ours, stock, atol=1e-5)
        alone = [model.model.layers[0].mlp.gate_proj(x[i : i + 1]) for i in (0, 17, 36)]
        for row, single in zip((0, 17, 36), alone):
            assert torch.equal(single[0], ours[row])  # bitwise: the row's batch does not change it


def test_onednn_block_puts_every_layer_back_as_it_was():
    """cbgen bench's cbgen-onednn path switches oneDNN on for one path only: afterwards the model computes bitwise what
    it computed before, its chunked vocabulary projection included."""
    model = tiny_llama(vocab_size=3 * linear.VOCAB_CHUNK)
    assert chunk_vocab_projection(model)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(ids).logits
        with onednn_linear(model) as count:
            assert count == 15 and uses_onednn_linear(model) and linear_kind(model) == "onednn"
            assert torch.allclose(model(ids).logits, before, atol=1e-5)
        assert not uses_onednn_linear(model)
        assert linear_kind(model) == f"stock, vocabulary in {linear.VOCAB_CHUNK}-column chunks"
        assert "forward" not in vars(model.model.layers[0].mlp.gate_proj)
        assert torch.equal(model(ids).logits, before)
        use_onednn_linear(model)  # a model already on oneDNN (--onednn-linear) is left alone
        with onednn_linear(model) as count:
            assert count == 0
        assert uses_onednn_linear(model)


@pytest.mark.slow
def test_engine_gives_model_generate_tokens_with_onednn_linear():
    model = tiny_llama()
    use_onednn_linear(model)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(20, 60))]
    config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    batched = model.generate_batch(prompts, config)
    by_prompt = {tuple(o.prompt_ids): o.generated_tokens for o in batched.values()}
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            alone = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert by_prompt[tuple(prompt)] == alone[0, len(prompt):].tolist()


def test_run_with_onednn_linear_records_it(tiny_model_dir, tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"input_ids": [7 + i, 8, 9, 10]}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    assert run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "--device", "cpu", "--max-new-tokens", "4", "--onednn-linear", "-q"]) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["config"]["model"]["onednn_linear"] is True and manifest["counts"]["succeeded"] == 4
    assert manifest["model"]["linear"] == "onednn"


def test_run_records_the_chunked_vocabulary_projection(tiny_model_dir, tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"input_ids": [7 + i, 8, 9, 10]}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    assert run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "--device", "cpu", "--max-new-tokens", "4", "-q"]) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["model"]["linear"] == f"stock, vocabulary in {linear.VOCAB_CHUNK}-column chunks"


def test_bfloat16_linear_layers_are_prepacked_when_asked(tiny_model_dir, tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"input_ids": [7 + i, 8, 9, 10]}) + "\n" for i in range(4)))
    kinds = {}
    for flag in ("", "--onednn-linear", "--stock-linear", "--no-linear-row-buckets"):
        out = tmp_path / f"out{flag}"
        assert run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "bfloat16",
                        "--device", "cpu", "--max-new-tokens", "4", "-q", *([flag] if flag else [])]) == 0
        manifest = json.loads((out / "run.json").read_text())
        assert manifest["counts"]["succeeded"] == 4
        kinds[flag] = manifest["model"]["linear"]
    buckets = "stock, rows in buckets (multiples of 8 to 64, then four per doubling)"  # the default, in bfloat16
    assert kinds == {"": buckets, "--onednn-linear": "onednn", "--stock-linear": buckets,
                     "--no-linear-row-buckets": "stock"}


def test_prepacked_bfloat16_layers_give_the_stock_results_to_rounding():
    model = tiny_llama().to(torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        stock = [model.model.layers[0].mlp.gate_proj(x[:rows]) for rows in (1, 7, 64)]
        assert use_onednn_linear(model) == 15 and linear_kind(model) == "onednn"
        ours = [model.model.layers[0].mlp.gate_proj(x[:rows]) for rows in (1, 7, 64)]
    for a, b in zip(stock, ours):
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-3)


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
    assert bucket_linear_rows(model) == 15 and bucket_linear_rows(tiny_llama()) == 0  # float32: MKL, no such cache
    layer = model.model.layers[0].mlp.up_proj
    counts = _RowCounts()
    with torch.no_grad():
        for rows in range(1, 301):
            x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
            stock = torch.nn.functional.linear(x, layer.weight)
            with counts:
                ours = layer(x)
            assert ours.shape == stock.shape == (1, rows, 160)
            torch.testing.assert_close(ours, stock)
    assert counts.rows == {8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320}


def test_batch_invariant_tiles_replace_the_buckets_and_give_them_back():
    model = tiny_llama().to(torch.bfloat16)
    bucket_linear_rows(model)
    layer = model.model.layers[1].self_attn.o_proj
    with batch_invariant_linear(model):
        assert vars(layer)["forward"].__func__ is not linear._bucketed_forward
    assert vars(layer)["forward"].__func__ is linear._bucketed_forward


def test_row_buckets_asked_for_are_refused_where_they_do_not_apply(tiny_model_dir, tmp_path, capsys):
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"input_ids": [7 + i, 8, 9, 10]}) + "\n" for i in range(4)))
    base = ["run", str(source), "--model", str(tiny_model_dir), "--device", "cpu", "--max-new-tokens", "4", "-q"]
    assert run_cli([*base, "-o", str(tmp_path / "f32"), "--dtype", "float32"]) == 0  # the default: not in float32
    manifest = json.loads((tmp_path / "f32" / "run.json").read_text())
    assert manifest["model"]["linear"] == f"stock, vocabulary in {linear.VOCAB_CHUNK}-column chunks"
    assert run_cli([*base, "-o", str(tmp_path / "asked"), "--dtype", "float32", "--linear-row-buckets"]) == 2
    assert "--linear-row-buckets applies to bfloat16 or float16 on CPU" in capsys.readouterr().err
    assert run_cli([*base, "-o", str(tmp_path / "both"), "--linear-row-buckets", "--onednn-linear"]) == 2
    assert "use one" in capsys.readouterr().err
