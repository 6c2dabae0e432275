"""Peak memory of a job on a Q8_0 GGUF file: cbgen with its int8 weights (the default for such a file), cbgen with
them dequantized to float32 (--quantize none), and llama.cpp's own llama-batched-bench on the same file, each in a
fresh process, side by side (peak RSS of the process, from the kernel's accounting of finished children).

The file defaults to the suite's 1B Q8_0 conversion (`cbgen bench --suite` makes it: cbgen.bench.scale); each cbgen
run is done twice, the first filling cbgen's converted-GGUF cache (a cold start), the second reading it (warm).

    python benchmarks/q8_memory.py
    python benchmarks/q8_memory.py --gguf path/to/model-q8_0.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRAPPER = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
           "stderr=subprocess.DEVNULL).returncode; print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)")


def peak_of(command: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(peak RSS in GiB, seconds, exit code) of `command`, run by a fresh wrapper process whose only child it is (so
    the kernel's largest-child figure is this command's)."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", WRAPPER, *command], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]) / 2**20, time.perf_counter() - started, int(out[1])


def main() -> None:
    from cbgen.bench.llamacpp import llamacpp_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=llamacpp_dir() / "models" / "llama-1b" / "llama-1b-q8_0.gguf")
    args = parser.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"q8_memory.py: no file {args.gguf} (cbgen bench --suite makes it, or give --gguf)")
    bench = llamacpp_dir() / "build" / "bin" / "llama-batched-bench"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "CBGEN_RESULT_CACHE": "off"}  # every run computes its answers
    with tempfile.TemporaryDirectory(prefix="cbgen-q8-memory-") as folder:
        prompts = Path(folder) / "p.jsonl"
        prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"Write about the number {i}."}) + "\n"
                                   for i in range(4)))
        runs = []
        if bench.is_file():
            runs.append(("llama.cpp llama-batched-bench", [str(bench), "-m", str(args.gguf), "-c", "2048", "-b", "512",
                                                           "-ub", "512", "-npp", "128", "-ntg", "8", "-npl", "4",
                                                           "-t", str(os.cpu_count())]))
        for quantize in ("auto", "none"):  # auto: int8, the file's own values
            for start in ("cold", "warm"):
                cache = Path(folder) / f"cache-{quantize}"
                runs.append((f"cbgen --quantize {quantize} ({start})",
                             [sys.executable, "-m", "cbgen", "run", str(prompts), "-o",
                              str(Path(folder) / f"out-{quantize}-{start}"), "--model", str(args.gguf),
                              "--quantize", quantize, "--max-new-tokens", "8", "-q", "--model-cache-dir", str(cache)]))
        print(f"{args.gguf.name} ({args.gguf.stat().st_size / 2**30:.2f} GiB), each run alone in a fresh process:")
        for name, command in runs:
            peak, seconds, code = peak_of(command, env)
            print(f"  {name:<40} peak RSS {peak:6.2f} GiB  {seconds:6.1f} s" + (f"  exit {code}" if code else ""))


if __name__ == "__main__":
    main()
