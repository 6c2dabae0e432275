"""`cbgen bench`'s llamacpp path: skipped with its reason when llama.cpp or the GGUF is missing, and its scheduler
(slots, prompt chunks, stops) driven against a stand-in for llama.cpp's C API that predicts `last token + 1`. The real
library is built by benchmarks/build_llamacpp.sh, which CI does not run (15-25 minutes); its figures are in
docs/performance.md.
"""

from __future__ import annotations

import ctypes
import json
from types import SimpleNamespace

import pytest

from cbgen.bench import build_workloads
from cbgen.bench.llamacpp import LlamaCpp, find_gguf
from cbgen.cli import run_cli

VOCAB = 50


class FakeLlama:
    """llama.cpp's C API as LlamaCpp uses it. Its model predicts the last token of each sequence + 1; it checks that
    every sequence's positions follow on from what its slot holds, and that a step never exceeds n_batch."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # slot -> tokens in its KV
        self.steps: list[int] = []  # tokens per decode call
        self.logits: dict[int, ctypes.Array] = {}

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return SimpleNamespace(n_gpu_layers=-1, use_extra_bufts=True)

    def llama_model_load_from_file(self, path, params):
        self.model_params = params
        return object()

    def llama_context_default_params(self):
        return SimpleNamespace()

    def llama_init_from_model(self, model, params):
        self.params = params
        return object()

    def llama_model_get_vocab(self, model):
        return object()

    def llama_vocab_n_tokens(self, vocab):
        return VOCAB

    def llama_get_memory(self, ctx):
        return object()

    def llama_batch_init(self, n, embd, n_seq_max):
        return SimpleNamespace(token=[0] * n, pos=[0] * n, n_seq_id=[0] * n, seq_id=[[0] for _ in range(n)],
                               logits=[False] * n, n_tokens=0)

    def llama_memory_clear(self, memory, data):
        self.held.clear()

    def llama_memory_seq_rm(self, memory, slot, start, end):
        self.held.pop(slot, None)

    def llama_decode(self, ctx, batch):
        assert 0 < batch.n_tokens <= self.params.n_batch
        self.steps.append(batch.n_tokens)
        self.logits = {}
        for i in range(batch.n_tokens):
            slot = batch.seq_id[i][0]
            assert 0 <= slot < self.params.n_seq_max
            assert batch.pos[i] == self.held.get(slot, 0), "positions must follow on"
            self.held[slot] = batch.pos[i] + 1
            if batch.logits[i]:
                row = (ctypes.c_float * VOCAB)()
                row[(batch.token[i] + 1) % VOCAB] = 1.0
                self.logits[i] = row
        return 0

    def llama_get_logits_ith(self, ctx, i):
        return ctypes.cast(self.logits[i], ctypes.POINTER(ctypes.c_float))

    def llama_batch_free(self, batch):
        pass

    def llama_free(self, ctx):
        pass

    def llama_model_free(self, model):
        pass


def test_scheduler_chunks_prompts_reuses_slots_and_stops_at_eos_or_cap():
    lib = FakeLlama()
    engine = LlamaCpp(lib, "m.gguf", threads=2, parallel=2, max_len=64, n_batch=8)
    prompts = [[1, 2, 3], [10] * 11, [40, 41], [20, 21, 22, 23]]  # the second is longer than one step
    caps = [4, 3, 10, 2]
    run = engine.run(prompts, caps, eos={45})
    assert run.tokens == [[4, 5, 6, 7], [11, 12, 13], [42, 43, 44, 45], [24, 25]]  # the third ends at its EOS
    assert max(lib.steps) == 8 and lib.params.n_seq_max == 2
    assert not lib.held  # every finished sequence gave its slot back


@pytest.mark.parametrize("value, extra", [(None, True), ("0", False), ("false", False), ("1", True)])
def test_llama_arg_repack_turns_off_the_extra_buffer_types(monkeypatch, value, extra):
    # llama.cpp's AMX kernels faulted on a Sapphire Rapids VM: LLAMA_ARG_REPACK=0 loads without them, as --no-repack
    if value is None:
        monkeypatch.delenv("LLAMA_ARG_REPACK", raising=False)
    else:
        monkeypatch.setenv("LLAMA_ARG_REPACK", value)
    lib = FakeLlama()
    LlamaCpp(lib, "m.gguf", threads=2, parallel=2, max_len=64)
    assert lib.model_params.use_extra_bufts is extra and lib.model_params.n_gpu_layers == 0


def test_fixed_workload_has_llama_batched_bench_shape(tiny_model_dir):
    from transformers import AutoTokenizer

    (fixed,) = build_workloads(AutoTokenizer.from_pretrained(tiny_model_dir), "small", ["fixed"])
    assert len(fixed.prompts) == 64 and fixed.max_new_tokens == 64
    assert {len(p) for p in fixed.prompts} == {128}
    assert len({tuple(p) for p in fixed.prompts}) == 64  # no two alike: nothing for the prefix cache to share


def test_missing_gguf_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CBGEN_LLAMACPP_DIR", str(tmp_path))
    gguf, reason = find_gguf(None, embedded=True, dtype="float32")
    assert gguf is None and str(tmp_path / "models" / "SmolLM2-135M-Instruct-f32.gguf") in reason
    assert "build_llamacpp.sh" in reason
    assert find_gguf(str(tmp_path / "no.gguf"), embedded=False, dtype="float32")[1].startswith("--llamacpp-model")
    assert "--llamacpp-model" in find_gguf(None, embedded=False, dtype="float32")[1]
    gguf, reason = find_gguf(None, embedded=True, dtype="q8_0")  # the llamacpp-q8_0 path's file
    assert gguf is None and "SmolLM2-135M-Instruct-q8_0.gguf" in reason
    assert "--llamacpp-q8-model" in find_gguf(None, embedded=False, dtype="q8_0")[1]


@pytest.mark.slow
def test_bench_skips_llamacpp_with_its_reason(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CBGEN_LLAMACPP_DIR", str(tmp_path / "none"))
    out = tmp_path / "bench"
    code = run_cli(["bench", "--model", str(tiny_model_dir), "--size", "tiny", "--workloads", "fixed",
                    "--paths", "cbgen,llamacpp,llamacpp-q8_0", "-o", str(out)])
    assert code == 0
    data = json.loads((out / "bench.json").read_text())
    assert [r["path"] for r in data["rows"]] == ["cbgen"]
    assert "--llamacpp-model" in data["meta"]["skipped"]["llamacpp"]  # a model folder: its GGUF must be named
    assert "--llamacpp-q8-model" in data["meta"]["skipped"]["llamacpp-q8_0"]
    assert "llamacpp path skipped:" in capsys.readouterr().err
