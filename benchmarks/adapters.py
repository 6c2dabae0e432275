"""What LoRA adapters cost a job: the same 64 prompts of 128 tokens (64 new tokens each, greedy: the suite's fixed
workload) on one loaded model, with no adapter, with one adapter for every row, and with rows split between two
adapters (cbgen's way: each adapter's rows together, merged into the base weights), runs interleaved. Also, for the
record of why cbgen merges: the same rows through PEFT's unmerged LoRA layers (each layer's low-rank product added to
its output, the way a per-row adapter batch would compute), one adapter for every row. Prints each run's seconds,
the ratios (goal: two adapters <= 1.3x none) and what a merge holds in memory.

    python benchmarks/adapters.py                     # the embedded model, rank 16 on every projection, 3 rounds
    python benchmarks/adapters.py --rounds 1 --prompts 16 --new 16   # a quick check that it runs

The adapters are made here with random factors (PEFT's layout, saved as PEFT saves them): their speed does not
depend on their values. Name the machine beside the figures (lscpu): they compare only within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model: torch.nn.Module, folder: Path, rank: int, seed: int) -> Path:
    """A LoRA adapter over every projection of `model` with random factors, saved as PEFT saves one (the model is
    not touched)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, module.in_features,
                                                                            generator=generator) * 0.01
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, rank,
                                                                            generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS)).save_pretrained(folder)
    return folder


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from cbgen.bench.workloads import build_workloads
    from cbgen.config import build_config
    from cbgen.config.flat import keyword_overrides
    from cbgen.job.sequence import generate_in_memory
    from cbgen.model.adapters import applied, resolve
    from cbgen.model.load import load_model
    from cbgen.progress import NullProgress

    base = build_config(None, keyword_overrides({"model": args.model} if args.model else {}))
    loaded = load_model(base.model)
    (fixed,) = build_workloads(loaded.tokenizer, "small", ["fixed"])
    prompts = [list(p) for p in fixed.prompts][: args.prompts]
    folder = Path(tempfile.mkdtemp(prefix="cbgen-adapters-"))
    a = make_adapter(loaded.model, folder / "a", args.rank, 1)
    b = make_adapter(loaded.model, folder / "b", args.rank, 2)
    common = {"max_new_tokens": args.new, "ignore_eos": True, "result_cache": False,
              **({"model": args.model} if args.model else {})}

    def job(**settings):
        return build_config(None, keyword_overrides(common | settings))

    rows_none = [{"id": str(i), "input_ids": ids} for i, ids in enumerate(prompts)]
    rows_two = [row | {"adapter": "ab"[i % 2]} for i, row in enumerate(rows_none)]
    paths = {
        "no adapter": (job(), rows_none),
        "one adapter, every row": (job(adapter=str(a)), rows_none),
        "two adapters, rows split": (job(adapter=[f"a={a}", f"b={b}"]), rows_two),
    }

    def timed(name: str) -> float:
        config, rows = paths[name]
        started = time.perf_counter()
        out = generate_in_memory(config, loaded, rows, NullProgress())
        seconds = time.perf_counter() - started
        assert sum(len(r["token_ids"]) for r in out) == len(rows) * args.new
        return seconds

    def unmerged() -> float:
        """One adapter's LoRA layers in place of the projections, unmerged (PEFT's forward adds x A^T B^T * scale
        to each base output), every row through one engine."""
        from peft import PeftModel

        wrapped = PeftModel.from_pretrained(loaded.model, str(a), is_trainable=False)
        try:
            started = time.perf_counter()
            generate_in_memory(job(), loaded, rows_none, NullProgress())
            return time.perf_counter() - started
        finally:
            wrapped.unload()

    for name in paths:  # warm-up: kernels built, first-call costs paid, off the clock
        config, rows = paths[name]
        generate_in_memory(config, loaded, rows[:4], NullProgress())
    seconds: dict[str, list[float]] = {name: [] for name in [*paths, "PEFT's unmerged layers, one adapter"]}
    for round_ in range(args.rounds):
        for name in paths:
            seconds[name].append(timed(name))
        seconds["PEFT's unmerged layers, one adapter"].append(unmerged())
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()), flush=True)

    adapter = resolve([str(a)]).default
    before = rss_mb()
    with applied(loaded.model, adapter):
        merged = rss_mb()
    merge_started = time.perf_counter()
    with applied(loaded.model, adapter):
        merge_seconds = time.perf_counter() - merge_started
    targeted = sum(m.weight.numel() * m.weight.element_size() for n, m in loaded.model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS) / 2**20
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    none = medians["no adapter"]
    report = {
        "model": loaded.source.name, "dtype": str(loaded.dtype).removeprefix("torch."), "prompts": len(prompts),
        "new_tokens": args.new, "rank": args.rank, "threads": torch.get_num_threads(), "seconds": seconds,
        "ratios_to_no_adapter": {name: round(m / none, 3) for name, m in medians.items()},
        "merge": {"seconds": round(merge_seconds, 3), "rss_added_mb": round(merged - before, 1),
                  "targeted_layers_mb": round(targeted, 1)},
    }
    print(json.dumps(report, indent=2))
    two = report["ratios_to_no_adapter"]["two adapters, rows split"]
    print(f"two adapters / none: {two:.3f} (goal <= 1.3); a merge: {merge_seconds:.2f} s, {merged - before:.0f} MB "
          f"held while merged (the targeted layers: {targeted:.0f} MB)")


if __name__ == "__main__":
    main()
