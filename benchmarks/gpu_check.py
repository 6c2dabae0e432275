"""The GPU check: everything cbgen does only on CUDA, in one script that finishes in under 8 minutes on one GPU.

1. A smoke job (`cbgen run`, 16 prompts, 32 new tokens, random-weight SmolLM2-135M shape) for each attention choice
   (sdpa, paged|eager, flash_attention_2 when installed) with CUDA graphs on and off, its greedy tokens checked
   against `model.generate` one prompt at a time (float32 where the attention allows it; bfloat16 for flash, where
   tokens may drift with batch composition, so the share that agrees is reported), and the KV cache the engine sized
   from free device memory read back from run.json, with the decoder layers run.json names: cbgen's fused layers
   (cbgen.model.fused) are written and proven for CPU only, so on CUDA they must say off (transformers' layers).
2. Batch invariance: the same 16 prompts (seeded samples with logprobs, and greedy) at up to 16 and at 3 requests
   per batch, shuffled, in bfloat16 with the attention cbgen picks on this device, bitwise compared: with the stock
   numerics, with cbgen's fixed-shape linear tiles (cbgen.model.invariant; the attention stays the device's), and,
   where it applies (cbgen's CPU attention), with --batch-invariant.
3. `cbgen bench` on a random-weight 1B Llama shape in bfloat16: the mixed and shared-prefix workloads through cbgen,
   plain `generate_batch` and static batching.
4. One table of all of it.

    python benchmarks/gpu_check.py                      # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu --quick # the script's own plumbing, on any machine (no graphs/flash)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

os.environ["CBGEN_RESULT_CACHE"] = "off"  # every timed run computes: the result cache would answer repeats

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SMOKE_MODEL = "random-weights:smollm2-135m"
BENCH_MODEL = "random-weights:llama-1b"


def attention_choices(device: str) -> list[tuple[str, str]]:
    """(attention implementation, dtype) pairs to smoke-test on this device."""
    choices = [("sdpa", "float32"), ("paged|eager", "float32")]
    if device == "cuda":
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            choices.append(("flash_attention_2", "bfloat16"))
    return choices


def reference_tokens(model_name: str, dtype: str, device: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """model.generate, one prompt at a time, greedy: what every batch composition should reproduce."""
    import torch

    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    loaded = load_model(ModelSection(model=model_name, dtype=dtype, device=device, attn_implementation="sdpa"))
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=loaded.model.device)
        with torch.no_grad():
            generated = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                              do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(generated[0, len(prompt):].tolist())
    return out


def smoke(work: Path, device: str, graphs: list[bool], quick: bool) -> list[dict]:
    from cbgen.cli import run_cli
    from cbgen.outputs import read_shards

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 49152) for _ in range(rng.randint(8, 120))] for _ in range(8 if quick else 16)]
    new = 8 if quick else 32
    source = work / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    references: dict[str, list[list[int]]] = {}
    rows = []
    for attention, dtype in attention_choices(device):
        if dtype not in references:
            references[dtype] = reference_tokens(SMOKE_MODEL, dtype, device, prompts, new)
        for graph in graphs:
            out = work / f"smoke-{attention.replace('|', '-')}-{graph}"
            start = time.perf_counter()
            code = run_cli(["run", str(source), "-o", str(out), "--model", SMOKE_MODEL, "--device", device,
                            "--dtype", dtype, "--attn-implementation", attention, "--max-new-tokens", str(new),
                            "--use-cuda-graph" if graph else "--no-cuda-graph", "-q"])
            seconds = time.perf_counter() - start
            got = {int(r["id"]): r.get("token_ids") for r in read_shards(out)} if code == 0 else {}
            # an end-of-sequence token stops cbgen's request early; the reference runs on: compare what both have
            same = sum(bool(got.get(i)) and got[i] == ref[:len(got[i])] for i, ref in enumerate(references[dtype]))
            manifest = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
            kv = manifest.get("kv_cache")
            kv = {key: kv.get(key) for key in ("chosen_by", "num_blocks", "page_size", "bytes")} if kv else None
            layers = manifest.get("engine_scope", {}).get("decoder_layers", {})
            fused_ok = layers.get("fused") is (device == "cpu")  # the embedded shape is Llama: fused on CPU only
            rows.append({"check": f"smoke {attention}, {dtype}, cuda graphs {'on' if graph else 'off'}",
                         "result": ("ok" if code == 0 and len(got) == len(prompts) and fused_ok
                                    else f"exit {code}" if code else "FAIL: fused layers off CPU"),
                         "detail": f"{same}/{len(prompts)} greedy = model.generate; {seconds:.1f} s; KV {kv}; "
                                   f"decoder layers {layers.get('why')}"})
    return rows


def invariance(device: str, quick: bool) -> list[dict]:
    """Sequences identical at two batch sizes (tokens / tokens and logprobs), stock, with linear tiles, and with
    --batch-invariant where it applies."""
    from contextlib import nullcontext

    import cbgen
    from cbgen.model.invariant import batch_invariant_linear

    rng = random.Random(1)
    rows = [{"id": str(i), "input_ids": [rng.randrange(1, 49152) for _ in range(rng.randint(8, 120))]}
            for i in range(16)]
    shuffled = rows[:]
    random.Random(2).shuffle(shuffled)
    new = 8 if quick else 32
    results = []
    variants = [("stock", False, False), ("linear tiles", False, True)]
    if device == "cpu":  # cbgen's CPU attention applies to this model: the whole of --batch-invariant
        variants.append(("--batch-invariant", True, False))
    for name, invariant, tiles in variants:
        with cbgen.Generator(model=SMOKE_MODEL, device=device, dtype="bfloat16", progress=False,
                             batch_invariant=invariant) as generator:
            for label, settings in (("seeded", dict(temperature=1.0, seed=3, num_return_sequences=2)), ("greedy", {})):
                with batch_invariant_linear(generator.loaded.model) if tiles else nullcontext():
                    first, second = [{(r.id, r.sample_index): (r.token_ids, r.logprobs)
                                      for r in generator.generate(order, max_new_tokens=new, logprobs=True,
                                                                  max_requests_per_batch=limit, **settings)}
                                     for order, limit in ((rows, 16), (shuffled, 3))]
                tokens = sum(first[k][0] == second[k][0] for k in first)
                both = sum(first[k] == second[k] for k in first)
                results.append({"check": f"invariance {label}, {name}, bfloat16",
                                "result": f"{tokens}/{len(first)} / {both}/{len(first)}",
                                "detail": "sequences identical at 16 and 3 requests per batch: tokens / tokens and "
                                          f"logprobs; attention {generator.loaded.attn_implementation}"})
    return results


def bench(work: Path, device: str, quick: bool) -> list[dict]:
    from cbgen.cli import run_cli

    out = work / "bench"
    args = ["bench", "--model", "random-weights:smollm2-135m" if quick else BENCH_MODEL, "--device", device,
            "--size", "tiny" if quick else "small", "--workloads", "mixed,shared-prefix",
            "--paths", "cbgen,generate_batch,static", "-o", str(out)]
    if device == "cuda":
        args += ["--dtype", "bfloat16"]
    code = run_cli(args)
    if code != 0:
        return [{"check": "cbgen bench", "result": f"exit {code}", "detail": ""}]
    data = json.loads((out / "bench.json").read_text())
    return [{"check": f"bench {r['workload']} {r['path']}", "result": f"{r['total_tok_s']} tok/s",
             "detail": f"{r['seconds']} s, time vs cbgen {r['time_vs_cbgen']}, MFU {r['mfu']:.1%}"}
            for r in data["rows"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="Fewer prompts and a tiny bench.")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: torch sees no CUDA device (run it on a GPU machine, or --device cpu)")
    graphs = [False, True] if args.device == "cuda" else [False]
    started = time.perf_counter()
    rows = [{"check": "machine", "result": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
             "detail": f"torch {torch.__version__}, CUDA {torch.version.cuda}, bf16 "
                       f"{args.device == 'cuda' and torch.cuda.is_bf16_supported()}"}]
    with tempfile.TemporaryDirectory(prefix="cbgen-gpu-check-") as tmp:
        rows += smoke(Path(tmp), args.device, graphs, args.quick)
        rows += invariance(args.device, args.quick)
        if not args.skip_bench:
            rows += bench(Path(tmp), args.device, args.quick)
    table = Table(title=f"cbgen GPU check ({time.perf_counter() - started:.0f} s)", title_justify="left")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["check"], row["result"], row["detail"])
    console = Console(width=200)
    console.print(table)


if __name__ == "__main__":
    main()
