"""cbgen's int8 paths against its float path on the same 1B shape, the models loaded in one process and timed
alternately (round after round), so that a slower spell of the machine falls on all: the scale section's model
folder (float) and its Q8_0 file (read as it is: `--quantize int8`, and `w8a8` with `--w8a8`), the scale section's
quick workload (4 prompts of 64 tokens, 16 new; `--workload full`: 16 of 128, 64 new), split into the prefill (each
prompt and one token) and the whole workload. `--dtype bfloat16` runs every path in bfloat16 (the default on a CPU
with bfloat16 units).

The files are the scale section's (`cbgen bench --suite --sections scale` makes them once). About 5 GiB of memory.

    python benchmarks/int8_speed.py
    python benchmarks/int8_speed.py --rounds 3
    python benchmarks/int8_speed.py --workload full
    python benchmarks/int8_speed.py --workload full --dtype bfloat16 --w8a8
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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--w8a8", action="store_true", help="time --quantize w8a8 too (int8 rows)")
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
    paths = [(args.dtype, folder, "none"), ("int8", q8_0, "auto")] + ([("w8a8", q8_0, "w8a8")] if args.w8a8 else [])
    for name, model, quantize in paths:
        settings = ModelSection(model=str(model), dtype=args.dtype, device="cpu", quantize=quantize)
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
        theirs = statistics.median(took[args.dtype, part])
        medians = {name: statistics.median(took[name, part]) for name, _, _ in paths[1:]}
        others = "".join(f", {name} {t:.2f} s ({theirs / t:.2f}x)" for name, t in medians.items())
        print(f"{part}: {args.dtype} {theirs:.2f} s{others} (medians; x: the float path's time over it)")


if __name__ == "__main__":
    main()
