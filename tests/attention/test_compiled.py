"""cbgen.attention.compiled: the compiled kernel as the engine's attention gives the stock `sdpa` path's greedy tokens
and logprobs (float32) in every kind of continuous batch (fresh prompts, chunked prefill, mixed steps, padded
decode, sliding-window and hybrid models), with every call of the engine going through the kernel; and where the
kernel cannot be built, cbgen's eager path runs and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import cbgen.attention.compiled as compiled
from cbgen.attention import compiled_sdpa_forward, per_sequence_attention, registry
from cbgen.model import tiles_kernel
from tests.attention.test_per_sequence import GREEDY, SHAPE, generate, load, prompts, quiet_engine  # noqa: F401


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    return load(LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, **SHAPE), tmp_path_factory.mktemp("llama"))


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[int, ...]]:
    """Each kernel call's request count and query lengths; any engine call that would leave the kernel fails."""
    seen: list[tuple[int, ...]] = []
    requests = compiled._requests

    def recording(batch):
        seen.append(tuple(batch.q_lengths))
        return requests(batch)

    def refused(*args, **kwargs):
        raise AssertionError("a continuous-batching call left the compiled kernel")

    monkeypatch.setattr(compiled, "_requests", recording)
    monkeypatch.setattr(compiled, "batch_invariant_sdpa_forward", refused)
    return seen


def assert_same_as_stock(model, inputs: list[list[int]], **batching) -> None:
    assert compiled.compiled_attention_unavailable_reason(model) is None
    stock = generate(model, inputs, **batching)
    with per_sequence_attention(model, required=True, compiled=True) as active:
        assert active and registry.serving(model, "sdpa", compiled_sdpa_forward)
        ours = generate(model, inputs, **batching)
    for (stock_tokens, stock_logprobs), (our_tokens, our_logprobs) in zip(stock, ours):
        assert len(our_tokens) == GREEDY.max_new_tokens
        assert our_tokens == stock_tokens
        assert our_logprobs == pytest.approx(stock_logprobs, abs=1e-5)


def test_prefill_and_padded_decode_match_stock(llama, kernel_calls):
    assert_same_as_stock(llama, prompts(7, 19, 33, 48, 64, 90))
    assert any(len(q) > 1 and set(q) == {1} for q in kernel_calls)  # decode steps of several requests
    assert any(max(q) > 1 for q in kernel_calls)


def test_chunked_prefill_and_mixed_steps_match_stock(llama, kernel_calls):
    assert_same_as_stock(llama, prompts(5, 26, 47, 68, 89, 110, 131, 150), max_batch_tokens=64, page_size=256)
    assert any(1 in q and max(q) > 1 for q in kernel_calls)  # decode tokens and a prompt chunk in one call


def test_requests_across_pages_match_stock(llama, kernel_calls):
    assert_same_as_stock(llama, prompts(1, 7, 70, 19), page_size=16)
    assert kernel_calls


def test_sliding_window_and_hybrid_models_match_stock(tmp_path, kernel_calls):
    from transformers import MistralConfig, MistralForCausalLM

    mistral = load(MistralForCausalLM, MistralConfig(num_hidden_layers=2, sliding_window=24, **SHAPE), tmp_path / "m")
    assert_same_as_stock(mistral, prompts(5, 23, 41, 60, 77, 99), max_batch_tokens=32)
    config = Qwen2Config(num_hidden_layers=3, sliding_window=24, use_sliding_window=True, max_window_layers=1, **SHAPE)
    hybrid = load(Qwen2ForCausalLM, config, tmp_path / "q")
    assert hybrid.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert_same_as_stock(hybrid, prompts(5, 41, 77, 99), max_batch_tokens=32)


def test_a_head_dimension_the_kernel_does_not_hold_is_refused_with_the_reason(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    odd = load(LlamaForCausalLM, LlamaConfig(num_hidden_layers=1, **(SHAPE | {"hidden_size": 40})), tmp_path)
    assert "head dimension (10)" in compiled.compiled_attention_unavailable_reason(odd)


def _run(tmp_path, model_dir, *extra, env=None):
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say {i}"}) + "\n" for i in range(3)))
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    done = subprocess.run([sys.executable, "-m", "cbgen", "run", str(rows), "--model", str(model_dir), "-o", str(out),
                           "--max-new-tokens", "4", *extra], capture_output=True, text=True, timeout=300,
                          env=os.environ | (env or {}))
    return done, out


@pytest.mark.slow
def test_without_a_compiler_the_eager_attention_runs_and_says_why(tmp_path, tiny_model_dir):
    # a fresh kernel cache and a compiler that does not exist: the build fails, the job runs on the eager path
    env = {"CBGEN_CACHE_DIR": str(tmp_path / "cache"), "CBGEN_KERNEL_CACHE_DIR": str(tmp_path / "cache" / "kernels"),
           "CXX": str(tmp_path / "no-such-c++")}
    done, out = _run(tmp_path, tiny_model_dir, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    scope = json.loads((out / "run.json").read_text())["engine_scope"]
    assert scope["attention"] == "per-sequence"
    assert scope["attention_kernel"]["compiled"] is False
    assert scope["attention_kernel"]["why"].startswith("off: the build failed")
    assert "compiled kernel paged_attention unavailable" in done.stderr
    layers = scope["decoder_layers"]
    assert layers["compiled_operators"] is False and "norms, rotary and SiLU eager: the build failed" in layers["why"]
    assert scope["linear_kernel"] == {"compiled": False, "why": "off: the job is not batch-invariant"}
    done, out = _run(tmp_path, tiny_model_dir, "--batch-invariant", env=env)  # the linear layers: the fixed tiles
    assert done.returncode == 0, done.stderr[-2000:]
    scope = json.loads((out / "run.json").read_text())["engine_scope"]
    assert scope["batch_invariant"]["on"] is True and scope["linear_kernel"]["compiled"] is False
    assert scope["linear_kernel"]["why"].startswith("off: the build failed")
    # asked for, it must apply: a one-line error before anything runs
    done, _ = _run(tmp_path, tiny_model_dir, "--compiled-attention", env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--compiled-attention does not apply here: the build failed" in done.stderr


@pytest.mark.slow
def test_a_job_names_the_kernel_and_a_warm_start_loads_it_cached(tmp_path, tiny_model_dir):
    env = {"CBGEN_CACHE_DIR": str(tmp_path / "cache"), "CBGEN_KERNEL_CACHE_DIR": str(tmp_path / "cache" / "kernels")}
    for expected in ("built in", "cached"):
        done, out = _run(tmp_path, tiny_model_dir, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        scope = json.loads((out / "run.json").read_text())["engine_scope"]
        assert scope["attention_kernel"]["compiled"] is True and expected in scope["attention_kernel"]["why"]
        assert scope["batch_invariant"]["on"] is True
        layers = scope["decoder_layers"]  # the fused layers' compiled operators, built and cached the same way
        assert layers["compiled_operators"] is True and "norms, rotary and SiLU compiled" in layers["why"]
        linear = scope["linear_kernel"]  # the invariant linear layers' kernel, built beside them, where it serves
        dtype = getattr(torch, json.loads((out / "run.json").read_text())["model"]["dtype"])
        assert linear["compiled"] is (tiles_kernel.unfit_reason(dtype) is None)
        assert expected in linear["why"] if linear["compiled"] else linear["why"].startswith("off: ")
    built = sorted(path.name for path in (tmp_path / "cache" / "kernels").iterdir() if path.is_dir())  # builds
    capability = torch.backends.cpu.get_cpu_capability().lower()
    assert [name.split("-")[:2] for name in built] == [["decoder_ops", capability], ["linear_tiles", capability],
                                                       ["paged_attention", capability], ["sampling", capability]]
    # --no-compiled-attention: the eager path, and the old default (invariance for seeded jobs only)
    done, out = _run(tmp_path, tiny_model_dir, "--no-compiled-attention", env=env)
    scope = json.loads((out / "run.json").read_text())["engine_scope"]
    assert scope["attention"] == "per-sequence" and scope["attention_kernel"]["why"] == "off (--no-compiled-attention)"
    assert scope["batch_invariant"]["on"] is False
