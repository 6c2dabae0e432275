"""The KV cache's memory is taken as pages are written (cbgen.engine.cache_memory), with the same results."""

from __future__ import annotations

import json

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.engine import cache_memory
from cbgen.engine.cache_memory import lazy_cache_memory, mapped_zeros
from cbgen.outputs import read_shards
from tests.helpers import write_jsonl

MiB = 1024**2


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_mapped_zeros_are_zeros_and_take_no_memory_until_written():
    before = resident_bytes()
    tensor = mapped_zeros((256, MiB), torch.uint8)  # 256 MiB
    assert tensor.shape == (256, MiB) and tensor.dtype == torch.uint8 and tensor.is_contiguous()
    as_bf16 = tensor.view(-1).view(torch.bfloat16)  # how the cache's allocators view it
    assert float(as_bf16.float().abs().sum()) == 0.0  # read whole: still zeros, still not resident
    assert resident_bytes() - before < 32 * MiB
    tensor[:64] = 7  # written pages become resident, the rest stay free
    grown = resident_bytes() - before
    assert 64 * MiB <= grown < 96 * MiB
    assert int(tensor[64:].count_nonzero()) == 0 and int(tensor[:64].count_nonzero()) == 64 * MiB


def test_only_big_cpu_zeros_are_served_lazily():
    with lazy_cache_memory("cpu") as served:
        big = torch.zeros(cache_memory.LAZY_MIN_BYTES, dtype=torch.uint8, device="cpu")
        small = torch.zeros(16, dtype=torch.uint8)
        ones = torch.ones(4)
        preset = torch.zeros(cache_memory.LAZY_MIN_BYTES // 4, requires_grad=True)  # not a plain request: left alone
    assert served == [cache_memory.LAZY_MIN_BYTES]
    assert int(big.count_nonzero()) == 0 and int(small.count_nonzero()) == 0 and float(ones.sum()) == 4
    assert preset.requires_grad
    with lazy_cache_memory("cuda") as served:  # other devices: nothing changes (the call is not even made here)
        torch.zeros(cache_memory.LAZY_MIN_BYTES, dtype=torch.uint8)
    assert served == []


@pytest.mark.parametrize("seed", [None, 3])
def test_a_job_on_a_lazily_taken_cache_writes_what_a_zeroed_one_does(tiny_model_dir, tmp_path, monkeypatch, seed):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": "word " * (3 + 5 * i)} for i in range(6)])
    extra = ["--seed", str(seed), "--temperature", "0.9"] if seed is not None else []

    def run(out: str) -> tuple[list, dict]:
        assert run_cli(["run", str(prompts), "-o", str(tmp_path / out), "--model", str(tiny_model_dir), "--dtype",
                        "float32", "--max-new-tokens", "12", "--logprobs", "-q", *extra]) == 0
        rows = sorted(read_shards(tmp_path / out), key=lambda r: r["id"])
        return [(r["id"], r["token_ids"], r["logprobs"]) for r in rows], json.loads(
            (tmp_path / out / "run.json").read_text())["kv_cache"]

    monkeypatch.setattr(cache_memory, "LAZY_MIN_BYTES", 1)  # the tiny model's cache is a few MB: serve it lazily
    lazy_rows, lazy_kv = run("lazy")
    monkeypatch.setattr(cache_memory, "LAZY_MIN_BYTES", 1 << 60)  # nothing served lazily: transformers' own zeros
    zeroed_rows, zeroed_kv = run("zeroed")
    assert lazy_kv["resident"] == "as used" and zeroed_kv["resident"] == "all at start"
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
