"""One linear layer at a time, side by side in one process: torch's `F.linear`, cbgen's compiled float32 tiles
(cbgen/kernels/linear_tiles.cpp, the batch-invariant default) in panels of 64 and of 32 columns (cbgen.model.
tiles_kernel.block_n picks one per machine; at 32 columns a decode step's 12-24 rows run the kernel's own
decode loop where it is built with AVX2, timed against brgemm alone), and its int8 kernel (cbgen/kernels/
int8_linear.cpp, `--quantize int8`), on Llama-3.2-1B's projection shapes at a decode step's row counts and a prefill's.
On a CPU with bfloat16 units the bfloat16 tiles and the int8 kernel's bfloat16 path (int8_linear_bf16) too; and
`--quantize w8a8` (int8_linear_w8a8: int8 rows, integer products) against the machine's float tiles.

    python benchmarks/linear_kernels.py
    python benchmarks/linear_kernels.py --shapes 2048x8192 --rows 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2048x2048,512x2048,8192x2048,2048x8192",
                        help="out x in features of each layer (Llama-3.2-1B's q/o, k/v, gate/up, down)")
    parser.add_argument("--rows", default="1,16,64,512", help="rows a call")
    args = parser.parse_args()
    import torch

    from cbgen.kernels import kernel
    from cbgen.model import int8

    for name in (int8.KERNEL, "linear_tiles"):
        built = kernel(name)
        if not built.loaded:
            raise SystemExit(f"linear_kernels.py: the {name} kernel is unavailable: {built.detail}")
    ops = torch.ops.cbgen_kernels
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; milliseconds a call")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        weight = torch.randn(n, k, generator=generator) * 0.02
        q, scales = int8.quantize(weight)
        packed, packed_scales = int8.pack(q, scales)
        tiles = {width: ops.linear_pack(weight, width) for width in (64, 32)}
        bf16 = int8.bf16_arithmetic()
        tiles_bf16 = ops.linear_pack(weight.bfloat16(), 64) if bf16 else None
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=generator)
            calls = {"torch": partial(torch.nn.functional.linear, x, weight),
                     "tiles f32": partial(ops.linear_tiles, x, tiles[64], None, n),
                     "tiles f32 32": partial(ops.linear_tiles, x, tiles[32], None, n),
                     "brgemm 32": partial(ops.linear_tiles_brgemm, x, tiles[32], None, n),
                     "int8": partial(ops.int8_linear, x, packed, packed_scales, None, n)}
            if bf16:
                calls |= {"tiles bf16": partial(ops.linear_tiles, x.bfloat16(), tiles_bf16, None, n),
                          "int8 bf16": partial(ops.int8_linear_bf16, x.bfloat16(), packed, packed_scales, None, n)}
            # --quantize w8a8 (int8 rows too), on the rows the float path of this machine has
            calls["w8a8"] = partial(ops.int8_linear_w8a8, x.bfloat16() if bf16 else x, packed, packed_scales, None, n)
            reps = max(3, int(2e9 / (2 * m * n * k + 4 * n * k)))
            times: dict[str, list[float]] = {label: [] for label in calls}
            for _ in range(3):  # rounds in turn, so that a slower spell of the machine falls on every kernel
                for label, call in calls.items():
                    call()
                    started = time.perf_counter()
                    for _ in range(reps):
                        call()
                    times[label].append((time.perf_counter() - started) / reps)
            took = {label: statistics.median(t) for label, t in times.items()}
            print(f"{n}x{k}, {m} rows: " + ", ".join(f"{label} {t * 1e3:.2f}" for label, t in took.items()) +
                  f"; 32 / 64 columns {took['tiles f32 32'] / took['tiles f32']:.2f}"
                  f", int8 / tiles {took['int8'] / took['tiles f32']:.2f}"
                  f", 32 columns / brgemm alone {took['tiles f32 32'] / took['brgemm 32']:.2f}" +
                  (f", int8 bf16 / tiles bf16 {took['int8 bf16'] / took['tiles bf16']:.2f}" if bf16 else "") +
                  f", w8a8 / tiles {took['w8a8'] / took['tiles bf16' if bf16 else 'tiles f32']:.2f}")


if __name__ == "__main__":
    main()
