"""The paths `cbgen bench` can time, listed once: each path's name, which of cbgen.bench.paths.Bench's timings runs
it, and what it measures. Torch-free, so that `cbgen bench --help` and its checks name them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BenchPath:
    """One path: `runs` is the timing that runs it (cbgen, variant, generate_batch, static, llamacpp); a cbgen path
    has its request `order`; a variant the `Bench.cbgen` keywords it changes (on the same loaded model, after a
    warm-up of its own, with the share of requests whose greedy tokens equal the cbgen path's); a llama.cpp path
    the flag naming its GGUF file."""

    name: str
    runs: str
    about: str
    order: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    gguf_flag: str | None = None


_LISTED = [
    BenchPath("cbgen", "cbgen", "cbgen as `cbgen run` runs it: prefix-aware order, its admission gate", order="gated"),
    BenchPath("cbgen-ordered", "cbgen", "prefix-aware order without the gate", order="ordered"),
    BenchPath("cbgen-input-order", "cbgen", "the input's order, no gate", order="input"),
    BenchPath("cbgen-invariant", "variant", "--batch-invariant", settings={"invariant": True}),
    BenchPath("cbgen-variant", "variant", "--no-batch-invariant: stock linear layers (the compiled attention stays)",
              settings={"invariant": False}),
    BenchPath("cbgen-eager", "variant", "--no-compiled-attention --no-batch-invariant: cbgen's eager CPU attention, "
              "stock linear layers", settings={"invariant": False, "compiled": False}),
    BenchPath("cbgen-onednn", "variant", "--onednn-linear: every float32 or bfloat16 linear layer through oneDNN, "
              "weights prepacked", settings={"onednn": True}),
    BenchPath("cbgen-eager-ops", "variant", "--no-compiled-ops: the fused layers' norms, rotary and SiLU as torch's "
              "eager operators", settings={"ops": False}),
    BenchPath("cbgen-tiles", "variant", "--no-compiled-linear: the invariant linear layers in oneDNN's fixed tiles, "
              "not cbgen's kernel", settings={"linear_kernel": False}),
    BenchPath("generate_batch", "generate_batch", "transformers' own continuous batching, the same requests"),
    BenchPath("static", "static", "padded static batches through model.generate, at each --static-batch-sizes"),
    BenchPath("llamacpp", "llamacpp", "llama.cpp's batched generation on the model's GGUF in its precision",
              gguf_flag="--llamacpp-model"),
    BenchPath("llamacpp-q8_0", "llamacpp", "llama.cpp on the Q8_0 GGUF: the quantization a llama.cpp user would run",
              gguf_flag="--llamacpp-q8-model"),
]
BENCH_PATHS: dict[str, BenchPath] = {path.name: path for path in _LISTED}
