"""The prepacked-linear lever measured against the stock linear layers, alternating on one loaded model.

`cbgen bench --paths cbgen,cbgen-onednn --stock-linear` measures each path once, one after the other; on a machine
whose speed drifts from minute to minute (a shared VM), one pair can say little. This loads the model once with the
stock layers and runs the `fixed` workload (64 x (128 prompt + 64 new) tokens) and, with --mixed, the `mixed` one,
alternating stock and prepacked (the cbgen path with --onednn-linear: its engine packs the weights when it starts and
puts the layers back when it ends) --repeat times, then prints each run and the
median ratio.

    python benchmarks/prepacked_linear.py --repeat 3
"""

from __future__ import annotations

import argparse
import statistics

from cbgen.bench import Bench, BenchWorkload, build_workloads
from cbgen.config import ModelSection
from cbgen.model.load import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--mixed", action="store_true", help="Also the mixed workload.")
    args = parser.parse_args()
    loaded = load_model(ModelSection(dtype=args.dtype, onednn_linear=False))
    bench = Bench(loaded, {})
    names = ["fixed", "mixed"] if args.mixed else ["fixed"]
    for workload in build_workloads(loaded.tokenizer, "small", names):
        bench.cbgen(BenchWorkload("warm-up", workload.prompts[:8], 4), "input")
        bench.cbgen(BenchWorkload("warm-up", workload.prompts[:8], 4), "input", onednn=True)
        ratios = []
        for i in range(args.repeat):
            stock = bench.cbgen(workload).seconds
            packed = bench.cbgen(workload, onednn=True).seconds
            ratios.append(packed / stock)
            print(f"{workload.name} run {i + 1}: stock {stock:6.2f} s, prepacked {packed:6.2f} s, "
                  f"ratio {packed / stock:.3f}", flush=True)
        print(f"{workload.name}: median time ratio prepacked / stock {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
