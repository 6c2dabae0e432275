"""Peak memory of `cbgen run` against the number of prompts: it must not grow with the input.

Runs the same job (a tiny random Llama with SmolLM2's tokenizer, 8-token prompts, 1 new token each) on files of
different sizes, each in a fresh process, and prints the peak RSS of each and the difference.

    python benchmarks/memory.py                      # 10,000 and 200,000 prompts
    python benchmarks/memory.py --sizes 1000 20000
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 200_000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
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
