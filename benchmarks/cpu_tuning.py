"""Which ContinuousBatchingConfig settings give the most throughput on this CPU, through cbgen's engine path.

The workload is the one of the llama.cpp comparison (docs/performance.md): 64 sequences of 128 prompt tokens, 64 new
tokens each (end-of-sequence disabled, so every sequence generates exactly 64), embedded SmolLM2-135M. Prints prompt +
generated tokens/s and model FLOP utilisation for each setting, all measured in one process.

    python benchmarks/cpu_tuning.py
    python benchmarks/cpu_tuning.py --grid max_requests_per_batch=16,32,64 max_batch_tokens=512,2048
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

import torch
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from cbgen.bench import WORDS, matmul_flops, parameter_count
from cbgen.config import ModelSection
from cbgen.engine.engine import Engine, EngineSettings
from cbgen.engine.manager import ManagerSpec
from cbgen.model.load import load_model
from cbgen.records import PromptRecord, Request


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(length * 2)))["input_ids"]
        out.append(ids[:length])
    return out


def measure(loaded, inputs, new_tokens, fields, attention) -> tuple[float, int]:
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=len(inputs) * 2 + 8, **fields)
    engine = Engine(loaded.model, EngineSettings(
        spec=ManagerSpec(config, cb, attention=attention), max_in_flight=len(inputs), max_new_tokens=new_tokens,
        num_return_sequences=1, eos_token_ids=frozenset(), max_positions=None, prefix_gating=False))
    requests = [Request(PromptRecord(str(i), i, str(i)), input_ids=ids) for i, ids in enumerate(inputs)]
    start = time.perf_counter()
    generated = sum(len(c.token_ids) for group in engine.run(requests) for c in group)
    return time.perf_counter() - start, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto", help="auto (per-sequence) or off (stock sdpa)")
    parser.add_argument("--grid", nargs="*", default=["max_requests_per_batch=16,32,64",
                                                      "max_batch_tokens=512,1024,2048"])
    args = parser.parse_args()
    loaded = load_model(ModelSection(dtype=args.dtype))
    inputs = prompts(loaded.tokenizer, args.sequences, args.prompt_tokens)
    peak = matmul_flops(loaded.dtype)
    flops_per_token = 2 * parameter_count(loaded.model)
    measure(loaded, inputs[:2], 2, {}, args.attention)  # warm-up
    keys, values = zip(*[(k, [int(v) for v in vs.split(",")]) for k, vs in (g.split("=") for g in args.grid)])
    print(f"{args.sequences} x ({args.prompt_tokens} prompt + {args.new_tokens} new) tokens, {args.dtype}, "
          f"attention {args.attention}, {args.dtype} matmul {peak / 1e9:.0f} GFLOP/s, "
          f"torch threads {torch.get_num_threads()}")
    print(" ".join(f"{k:>24}" for k in keys) + f" {'seconds':>8} {'tok/s':>8} {'MFU':>6}")
    for combo in itertools.product(*values):
        fields = dict(zip(keys, combo))
        seconds, generated = measure(loaded, inputs, args.new_tokens, fields, args.attention)
        rate = (generated + args.sequences * args.prompt_tokens) / seconds
        print(" ".join(f"{v:>24}" for v in combo) + f" {seconds:8.2f} {rate:8.1f} {rate * flops_per_token / peak:6.1%}",
              flush=True)


if __name__ == "__main__":
    main()
