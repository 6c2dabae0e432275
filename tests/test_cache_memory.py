"""The KV cache's memory is taken as pages are written (cbgen.engine.kv_memory), with the same results."""

from __future__ import annotations

import ctypes
import json
import mmap

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.engine import kv_memory as cache_memory
from cbgen.engine.kv_memory import LazyCache, lazy_cache_memory
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

MiB = 1024**2


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_mapped_zeros_are_zeros_and_take_no_memory_until_written():
    before = resident_bytes()
    tensor = LazyCache().serve((256, MiB), torch.uint8)  # 256 MiB
    assert tensor.shape == (256, MiB) and tensor.dtype == torch.uint8 and tensor.is_contiguous()
    as_bf16 = tensor.view(-1).view(torch.bfloat16)  # how the cache's allocators view it
    # read whole with a reduction that makes no copy: a float copy's freed pages may stay resident (a malloc that
    # keeps freed memory, as one worker of the suite's had) and would be counted here as the mapping's
    low, high = as_bf16.aminmax()
    assert float(low) == 0.0 and float(high) == 0.0  # still zeros, still not resident
    assert resident_bytes() - before < 32 * MiB
    tensor[:64] = 7  # written pages become resident, the rest stay free
    grown = resident_bytes() - before
    assert 64 * MiB <= grown < 96 * MiB
    assert int(tensor[64:].count_nonzero()) == 0 and int(tensor[:64].count_nonzero()) == 64 * MiB


def test_only_big_cpu_zeros_are_served_lazily():
    with lazy_cache_memory() as served:
        big = torch.zeros(cache_memory.LAZY_MIN_BYTES, dtype=torch.uint8, device="cpu")
        small = torch.zeros(16, dtype=torch.uint8)
        ones = torch.ones(4)
        preset = torch.zeros(cache_memory.LAZY_MIN_BYTES // 4, requires_grad=True)  # not a plain request: left alone
    assert [len(m) for m in served.mappings.values()] == [cache_memory.LAZY_MIN_BYTES]
    assert list(served.mappings) == [big.data_ptr()]
    assert int(big.count_nonzero()) == 0 and int(small.count_nonzero()) == 0 and float(ones.sum()) == 4
    assert preset.requires_grad
    with lazy_cache_memory(enabled=False) as served:  # not planned (other devices): nothing changes
        torch.zeros(cache_memory.LAZY_MIN_BYTES, dtype=torch.uint8)
    assert not served


@pytest.mark.parametrize("seed", [None, 3])
def test_a_job_on_a_lazily_taken_cache_writes_what_a_zeroed_one_does(tiny_model_dir, tmp_path, monkeypatch, seed):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": "word " * (3 + 5 * i)} for i in range(6)])
    # seeded with two samples each: the copies share their prompt's blocks, and finished blocks are kept for reuse
    extra = ["--seed", str(seed), "--temperature", "0.9", "-n", "2"] if seed is not None else []

    def run(out: str) -> tuple[list, dict]:
        assert run_cli(["run", str(prompts), "-o", str(tmp_path / out), "--model", str(tiny_model_dir), "--dtype",
                        "float32", "--max-new-tokens", "12", "--logprobs", "-q", *extra]) == 0
        rows = sorted(read_shards(tmp_path / out), key=lambda r: (r["id"], r["token_ids"]))
        return [(r["id"], r["token_ids"], r["logprobs"]) for r in rows], json.loads(
            (tmp_path / out / "run.json").read_text())["kv_cache"]

    monkeypatch.setattr(cache_memory, "LAZY_MIN_BYTES", 1)  # the tiny model's cache is a few MB: serve it lazily
    lazy_rows, lazy_kv = run("lazy")
    monkeypatch.setattr(cache_memory, "LAZY_MIN_BYTES", 1 << 60)  # nothing served lazily: transformers' own zeros
    zeroed_rows, zeroed_kv = run("zeroed")
    assert lazy_kv["resident"] == "as used, returned when freed" and zeroed_kv["resident"] == "all at start"
    assert lazy_rows == zeroed_rows and all(tokens for _, tokens, _ in lazy_rows)


@pytest.mark.parametrize(("prompts", "extra", "sharing"), [
    (["alpha " * 30, "beta " * 30, "gamma " * 30], [], "off"),  # no full first page to share: nothing to reuse
    (["alpha " * 80, "beta " * 80, "gamma " * 80], [], "off"),  # full first pages, all different
    (["alpha " * 30, "beta " * 30, "gamma " * 30], ["-n", "2", "--temperature", "0.8"], "on"),  # copies share
    (["same start " * 40 + tail for tail in ("a", "b", "c")], [], "on"),  # a first page in common
    (["alpha " * 30, "beta " * 30], ["--config", "sharing.yaml"], "on"),  # the user's word
])
def test_block_sharing_stays_on_only_where_a_block_can_be_reused(tiny_model_dir, tmp_path, prompts, extra, sharing):
    (tmp_path / "sharing.yaml").write_text("batching:\n  allow_block_sharing: true\n")
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": p} for i, p in enumerate(prompts)])
    extra = [str(tmp_path / e) if e.endswith(".yaml") else e for e in extra]
    assert run_cli(["run", str(path), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir), "--dtype",
                    "float32", "--max-new-tokens", "4", "--page-size", "64", "-q", *extra]) == 0
    manifest = json.loads((tmp_path / "out" / "run.json").read_text())
    assert manifest["kv_cache"]["block_sharing"].split(" ")[0].rstrip(":") == sharing
    assert manifest["continuous_batching"]["allow_block_sharing"] is (sharing == "on")


def resident_bytes_of(tensor: torch.Tensor) -> int:
    """The bytes of the pages under `tensor` that are in RAM (mincore: exactly its range, where smaps would count a
    whole mapping, which the kernel may have merged with a neighbour)."""
    libc = ctypes.CDLL(None, use_errno=True)
    length = tensor.numel() * tensor.element_size()
    pages = (ctypes.c_ubyte * (-(-length // mmap.PAGESIZE)))()
    assert libc.mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(length), pages) == 0, ctypes.get_errno()
    return sum(page & 1 for page in pages) * mmap.PAGESIZE


@pytest.mark.parametrize("give_back", [True, False])
def test_blocks_freed_into_the_pool_give_their_pages_back(tiny_model_dir, monkeypatch, give_back):
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from cbgen.engine.manager import ManagerSpec, start_manager, stop_manager
    from cbgen.engine.scope import EngineScope, ScopePlan

    monkeypatch.setattr(cache_memory, "LAZY_MIN_BYTES", MiB)  # the tiny model's cache: 64 blocks of 128 KiB
    if not give_back:
        monkeypatch.setattr(cache_memory.LazyCache, "return_freed_blocks", lambda self, cache: None)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    spec = ManagerSpec(GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None),
                       ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256, allow_block_sharing=False),
                       scope=ScopePlan(lazy_kv_cache=True))
    scope = EngineScope(model, spec.scope).__enter__()
    manager, facts = start_manager(model, spec, scope)
    cache = manager.batch_processor.cache
    block = cache.cache_tensor.numel() // (cache.num_blocks + 2)
    after_warmup = resident_bytes_of(cache.cache_tensor)  # where a warm-up runs, its dummy requests wrote pages
    try:
        prompts = [[100 + 7 * i + j for j in range(300)] for i in range(6)]  # 340 tokens each: 2 blocks of 256
        for i, ids in enumerate(prompts):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=40)
        results = {}
        while len(results) < len(prompts):
            result = manager.get_result(timeout=60)
            assert result is not None, "the manager stopped before every request finished"
            results[result.request_id] = result.generated_tokens
        written = 6 * 340 * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x heads x head_dim x float32
        resident = resident_bytes_of(cache.cache_tensor)
    finally:
        for _ in stop_manager(manager):
            pass
        scope.__exit__(None, None, None)
    assert all(len(tokens) == 40 for tokens in results.values())
    if give_back:  # every block is free again: only the two never-allocated trash sectors may hold pages
        assert facts.resident == "as used, returned when freed"
        assert after_warmup == 0 and resident <= 2 * block
    else:
        assert facts.resident == "as used"
        assert resident >= 0.9 * written
