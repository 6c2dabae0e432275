"""cbgen's int8 path against its float32 path on the same 1B shape, both models loaded in one process and timed
alternately (round after round), so that a slower spell of the machine falls on both: the scale section's model
folder (float32) and its Q8_0 file (int8, read as it is), the scale section's quick workload (4 prompts of 64
tokens, 16 new; `--workload full`: 16 of 128, 64 new), split into the prefill (each prompt and one token) and the whole
workload.

The files are the scale section's (`cbgen bench --suite --sections scale` makes them once). About 5 GiB of memory.

    python benchmarks/int8_speed.py
    python benchmarks/int8_speed.py --rounds 3
    python benchmarks/int8_speed.py --workload full
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--workload", default="quick", choices=("quick", "full"),
                        help="the scale section's quick (4 x (64 + 16)) or full (16 x (128 + 64)) workload")
    args = parser.parse_args()
    from cbgen.bench.paths import Bench
    from cbgen.bench.scale import _workload, prepared
    from cbgen.bench.suite import Plan
    from cbgen.bench.workloads import BenchWorkload
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    files = prepared(args.shape, print)
    if isinstance(files, str):
        raise SystemExit(f"int8_speed.py: {files}")
    folder, _, q8_0 = files
    benches = {}
    for name, model, quantize in (("float32", folder, "none"), ("int8", q8_0, "auto")):
        settings = ModelSection(model=str(model), dtype="float32", device="cpu", quantize=quantize)
        loaded = load_model(settings)
        workload = _workload(loaded.tokenizer, Plan.of(args.workload == "quick", "small"))
        bench = Bench(loaded, {}, settings)
        bench.cbgen(BenchWorkload("warm-up", workload.prompts[:4], 4))
        benches[name] = (bench, workload)
    took: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for name, (bench, workload) in benches.items():
            for part, run in (("prefill", BenchWorkload("prefill", workload.prompts, 1)), ("whole", workload)):
                started = time.perf_counter()
                bench.cbgen(run)
                took.setdefault((name, part), []).append(time.perf_counter() - started)
                print(f"round {round_ + 1}: {name} {part} {took[name, part][-1]:.2f} s", flush=True)
    for part in ("prefill", "whole"):
        ours, theirs = statistics.median(took["int8", part]), statistics.median(took["float32", part])
        print(f"{part}: float32 {theirs:.2f} s, int8 {ours:.2f} s (medians): int8 {theirs / ours:.2f}x float32")


if __name__ == "__main__":
    main()
