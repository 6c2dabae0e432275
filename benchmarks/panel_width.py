"""cbgen's float32 tiles in panels of 64 output columns against 32 (cbgen.model.tiles_kernel.block_n), end to end on
the scale section's 1B model: one model loaded, the workload run with each width in turn, round after round (the
weights packed again at each switch, off the clock; which goes first turns each round), so that a slower spell of the
machine falls on both. `--int8` times the int8 kernel's panels instead (cbgen.model.int8.block_n, the same width):
the scale section's Q8_0 file loaded twice, once in each width (its panels are laid out as the file is read).

The files are the scale section's (`cbgen bench --suite --sections scale` makes them once). About 10 GiB of
memory (the weights and one packed copy; 3 GiB with --int8). `--embedded` runs the embedded model on the quick
suite's fixed workload (16 x (128 + 32)) instead.

    python benchmarks/panel_width.py
    python benchmarks/panel_width.py --rounds 3 --workload full
    python benchmarks/panel_width.py --int8 --workload full
    python benchmarks/panel_width.py --embedded --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--embedded", action="store_true", help="the embedded model, not the scale section's shape")
    parser.add_argument("--workload", default="quick", choices=("quick", "full"),
                        help="the scale section's quick (4 x (64 + 16)) or full (16 x (128 + 64)) workload")
    parser.add_argument("--int8", action="store_true", help="the int8 kernel's panels (the shape's Q8_0 file)")
    args = parser.parse_args()
    if args.int8 and args.embedded:
        parser.error("--int8 times the scale section's Q8_0 file; --embedded the embedded model's float32 tiles")
    import torch

    from cbgen.bench.paths import Bench
    from cbgen.bench.scale import _workload, prepared
    from cbgen.bench.suite import Plan
    from cbgen.bench.workloads import build_workloads, warm_up
    from cbgen.config import ModelSection
    from cbgen.model import packs, tiles_kernel
    from cbgen.model.load import load_model

    plan = Plan.of(args.workload == "quick", "small")
    if args.int8:
        int8_widths(args, plan)
        return
    if args.embedded:
        settings = ModelSection(dtype="float32", device="cpu", quantize="none")
        loaded = load_model(settings)
        workload = plan.cut(build_workloads(loaded.tokenizer, "small", ["fixed"])[0])
    else:
        files = prepared(args.shape, print)
        if isinstance(files, str):
            raise SystemExit(f"panel_width.py: {files}")
        settings = ModelSection(model=str(files[0]), dtype="float32", device="cpu", quantize="none")
        loaded = load_model(settings)
        workload = _workload(loaded.tokenizer, plan)
    bench = Bench(loaded, {}, settings)
    chosen = tiles_kernel.block_n

    def width(columns: int) -> Bench:
        tiles_kernel.block_n = lambda dtype: columns
        packs.clear()
        bench.cbgen(warm_up(workload))  # packs the weights at this width, off the clock
        return bench

    took = rounds(args.rounds, width, workload)
    tiles_kernel.block_n = chosen
    report(took, workload, chosen(torch.float32))


def int8_widths(args: argparse.Namespace, plan: Any) -> None:
    """The Q8_0 file loaded once in each width (block_n held to it while it loads), then timed in turn."""
    from cbgen.bench.paths import Bench
    from cbgen.bench.scale import _workload, prepared
    from cbgen.bench.workloads import warm_up
    from cbgen.config import ModelSection
    from cbgen.model import int8, tiles_kernel
    from cbgen.model.load import load_model

    files = prepared(args.shape, print)
    if isinstance(files, str):
        raise SystemExit(f"panel_width.py: {files}")
    settings = ModelSection(model=str(files[2]), dtype="float32", device="cpu", quantize="auto")
    chosen = tiles_kernel.block_n
    benches = {}
    for columns in (64, 32):
        tiles_kernel.block_n = lambda dtype, columns=columns: columns  # type: ignore[misc]
        loaded = load_model(settings)
        assert loaded.quantized is not None and int8.block_n() == columns
        benches[columns] = Bench(loaded, {}, settings)
    tiles_kernel.block_n = chosen
    workload = _workload(loaded.tokenizer, plan)
    for bench in benches.values():
        bench.cbgen(warm_up(workload))
    report(rounds(args.rounds, benches.__getitem__, workload), workload, int8.block_n())


def rounds(count: int, bench_at: Any, workload: Any) -> dict[int, list[float]]:
    took: dict[int, list[float]] = {64: [], 32: []}
    for round_ in range(count):
        for columns in sorted(took, reverse=round_ % 2 == 0):  # the order turns each round: neither always first
            bench = bench_at(columns)
            started = time.perf_counter()
            bench.cbgen(workload)
            took[columns].append(time.perf_counter() - started)
            print(f"round {round_ + 1}: {columns} columns {took[columns][-1]:.2f} s", flush=True)
    return took


def report(took: dict[int, list[float]], workload: Any, choice: int) -> None:
    import torch

    wide, narrow = statistics.median(took[64]), statistics.median(took[32])
    print(f"{len(workload.prompts)} x ({len(workload.prompts[0])} + {workload.max_new_tokens}), torch "
          f"{torch.backends.cpu.get_cpu_capability()}: 64 columns {wide:.2f} s, 32 columns {narrow:.2f} s (medians): "
          f"32 columns {wide / narrow:.2f}x; this machine's choice: {choice}")


if __name__ == "__main__":
    main()
