"""Where a step's time goes in cbgen's engine on this CPU: matmuls against attention against everything else.

Runs the `fixed` workload of `cbgen bench` (64 plain-text prompts of 128 tokens, 64 new tokens: llama-batched-bench's
shape; `--workload` picks another) through cbgen's engine path and profiles every step inside the manager's
generation thread, where torch.profiler must run (the step method is wrapped for this script only: transformers'
private names, checked against the installed version). Steps are split into prefill steps (any prompt tokens in
the batch) and decode steps (one token per sequence, at least --min-decode sequences); each kind gets its operators'
self time in buckets (matmul, attention, copies and gathers, elementwise, ...) and the wall time no operator accounts
for (Python: the model's module calls, scheduling, input preparation).

    python benchmarks/profile_step.py
    python benchmarks/profile_step.py --top 15 --max-batch-tokens 2048
    python benchmarks/profile_step.py --timing-only --onednn-linear   # step times only, unprofiled
    python benchmarks/profile_step.py --timing-only --no-fused-layers # transformers' decoder layers
    python benchmarks/profile_step.py --no-batch-invariant            # the compiled attention, stock linear layers
    python benchmarks/profile_step.py --no-compiled-attention --no-batch-invariant  # the eager attention
    python benchmarks/profile_step.py --model DIR --quantize int8     # a larger model's folder, int8 weights
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from transformers.generation.continuous_batching import continuous_api as api

from cbgen.bench import Bench, BenchWorkload, build_workloads, matmul_flops
from cbgen.config import ModelSection
from cbgen.model import dtype_name
from cbgen.model.load import load_model

BUCKETS = (  # first match wins; operator names as torch.profiler reports them
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn", "aten::_mkl", "onednn",
                "cbgen_kernels::linear_tiles", "cbgen_kernels::int8_linear")),
    ("attention", ("scaled_dot_product", "flash_attention", "aten::_softmax", "cbgen_kernels::")),
    ("copy / gather / index", ("aten::copy_", "aten::index", "aten::cat", "aten::gather", "aten::scatter",
                               "aten::contiguous", "aten::clone", "aten::to", "aten::_to_copy", "aten::embedding",
                               "aten::stack", "aten::where", "aten::masked", "aten::fill_", "aten::zero_",
                               "aten::empty", "aten::resize_", "aten::pad", "aten::constant_pad")),
    ("elementwise (norm, rope, silu)", ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt",
                                        "aten::silu", "aten::neg", "aten::sub", "aten::div", "aten::cos",
                                        "aten::sin", "aten::exp", "aten::sum")),
    ("sampling / logits", ("aten::argmax", "aten::max", "aten::topk", "aten::sort", "aten::log_softmax",
                           "aten::multinomial", "aten::gt", "aten::lt", "aten::eq", "aten::ne", "aten::any")),
)


def bucket(name: str) -> str:
    for label, needles in BUCKETS:
        if any(n in name for n in needles):
            return label
    return "other operators"


_profiles: dict[str, list] = defaultdict(list)  # "prefill" | "decode" -> (wall seconds, key_averages) per step


def _instrument(min_decode: int, timing_only: bool = False) -> None:
    """Profile each generation step where it runs (or only time it: `timing_only`), and file it as prefill or
    decode."""
    step = getattr(api.ContinuousBatchProcessor, "_generation_step", None)
    if step is None:
        raise SystemExit("profile_step.py: this transformers has no ContinuousBatchProcessor._generation_step to wrap")

    def profiled_step(self, model):
        io = self.inputs_and_outputs
        kind = ("decode" if io.num_q_tokens == io.num_request_in_batch else "prefill")
        if kind == "decode" and io.num_request_in_batch < min_decode:
            return step(self, model)
        if timing_only:
            start = time.perf_counter()
            result = step(self, model)
            _profiles[kind].append((time.perf_counter() - start, []))
            return result
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            result = step(self, model)
            wall = time.perf_counter() - start
        _profiles[kind].append((wall, prof.key_averages()))
        return result

    api.ContinuousBatchProcessor._generation_step = profiled_step


def summed(steps: list) -> tuple[float, dict[str, float], dict[str, float]]:
    """(wall seconds, self seconds per bucket, self seconds per operator) over profiled steps."""
    buckets: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    for _, events in steps:
        for event in events:
            seconds = event.self_cpu_time_total / 1e6
            buckets[bucket(event.key)] += seconds
            ops[event.key] += seconds
    return sum(wall for wall, _ in steps), buckets, ops


def show(title: str, steps: list, top: int) -> None:
    wall, buckets, ops = summed(steps)
    print(f"\n{title}: {len(steps)} steps, {wall:.2f} s, {wall / max(1, len(steps)) * 1000:.1f} ms per step")
    rows = sorted(buckets.items(), key=lambda kv: -kv[1])
    rows.append(("python (wall - operators)", max(0.0, wall - sum(buckets.values()))))
    for label, seconds in rows:
        print(f"  {label:<40} {seconds:8.3f} s {seconds / wall:6.1%}")
    print("  top operators by self time:")
    for name, seconds in sorted(ops.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {name:<50} {seconds:8.3f} s {seconds / wall:6.1%}")


def _scope(bench: Bench, invariant: bool | None) -> str:
    """What the profiled engine installs, in one line."""
    scope = bench.scope(invariant=invariant).describe()
    return (f"attention {scope['attention']}, linear layers {scope['linear']}, decoder layers "
            f"{scope['decoder_layers']['why']}, batch-invariant {scope['batch_invariant']['on']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="As for cbgen run (a folder, a GGUF file, a random-weight shape "
                        "such as llama-1b); default: the embedded SmolLM2")
    parser.add_argument("--quantize", default="auto", help="As for cbgen run: int8 weights, or none.")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-requests-per-batch", type=int, default=None)
    parser.add_argument("--size", default="small", help="tiny: a quick check of the script itself")
    parser.add_argument("--requests", type=int, help="Only the workload's first N prompts (the suite's 1B shape: "
                        "--requests 16 --min-decode 12)")
    parser.add_argument("--workload", default="fixed", help="The cbgen bench workload whose steps are profiled "
                        "(shared-prefix: prompt chunks after a cached prefix)")
    parser.add_argument("--onednn-linear", action="store_true", help="As for cbgen run.")
    parser.add_argument("--no-fused-layers", action="store_true", help="Transformers' decoder layers (as for cbgen "
                        "run): to compare against cbgen's fused ones.")
    parser.add_argument("--min-decode", type=int, default=48, help="Profile decode steps of at least this many "
                        "sequences (the full batch of 64, and the tail as requests finish).")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                        help="As for cbgen run (default: the job's default, on where the compiled attention runs).")
    parser.add_argument("--compiled-attention", action=argparse.BooleanOptionalAction, default=None,
                        help="As for cbgen run: cbgen's compiled attention kernel, or its eager CPU attention.")
    parser.add_argument("--compiled-ops", action=argparse.BooleanOptionalAction, default=None,
                        help="As for cbgen run: the fused layers' norms, rotary and SiLU compiled, or eager.")
    parser.add_argument("--compiled-linear", action=argparse.BooleanOptionalAction, default=None,
                        help="As for cbgen run: a batch-invariant job's linear layers in cbgen's compiled blocks, or "
                        "in the fixed tiles.")
    parser.add_argument("--timing-only", action="store_true", help="Time the steps without the profiler (which slows "
                        "them): the true step times, without the breakdown.")
    args = parser.parse_args()
    _instrument(args.min_decode, args.timing_only)
    section = ModelSection(model=args.model, quantize=args.quantize, dtype=args.dtype, onednn_linear=args.onednn_linear,
                           fused_layers=False if args.no_fused_layers else None,
                           compiled_attention=args.compiled_attention, compiled_ops=args.compiled_ops,
                           compiled_linear=args.compiled_linear)
    loaded = load_model(section)
    batching = {k: v for k, v in (("max_batch_tokens", args.max_batch_tokens),
                                  ("max_requests_per_batch", args.max_requests_per_batch)) if v is not None}
    bench = Bench(loaded, batching, section)
    fixed = build_workloads(loaded.tokenizer, args.size, [args.workload])[0]
    if args.requests:
        fixed = fixed.cut(args.requests, fixed.max_new_tokens)
    invariant = args.batch_invariant
    bench.cbgen(BenchWorkload("warm-up", fixed.prompts[:8], 4), "input", invariant=invariant)
    _profiles.clear()
    dtype = dtype_name(loaded.dtype)
    rate = matmul_flops(loaded.dtype)
    print(f"{len(fixed.prompts)} x ({len(fixed.prompts[0])} prompt + {fixed.max_new_tokens} new) tokens, {dtype}, "
          f"torch threads {torch.get_num_threads()}, {dtype} matmul {rate / 1e9:.0f} GFLOP/s, "
          f"batching {batching or 'defaults'}, {_scope(bench, invariant)}")
    measured = bench.cbgen(fixed, "gated", invariant=invariant)
    print(f"whole run (profiled, so slower than unprofiled): {measured.seconds:.1f} s")
    show("prefill steps (prompt chunks, with any decode tokens)", _profiles["prefill"], args.top)
    show(f"decode steps at >= {args.min_decode} sequences", _profiles["decode"], args.top)


if __name__ == "__main__":
    main()
