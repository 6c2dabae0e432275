"""Batch invariance, measured: how many sequences keep their tokens (and logprobs) when their batches change, with
cbgen's stock numerics and with --batch-invariant, and what that costs.

The same 16 prompts (-n 2, temperature 1, seed 7, 24 new tokens; and greedy) are generated on the embedded model in
input order with no batch limit, then shuffled with --max-requests-per-batch 3, then shuffled with
--max-batch-tokens 40 (which cuts prompts into chunks). The script counts the sequences of the second and third runs
whose tokens, and whose tokens and logprobs, are bitwise those of the first; and times the three generations.

Then the sources one by one: per linear shape of the model, whether a row's result moves with the number of rows and
its place among them (30 random cases), with one stock call and with cbgen's fixed-shape tiles (cbgen.model.invariant),
and the tiles' time against one stock call at 64 and 512 rows; and for attention (cbgen.attention.invariant), how
many of 100 random steps (1-24 requests, 1-5 query heads per KV head, prompt chunks and decode tokens) give some
request other bits than it gets alone, with query rows padded to a multiple of 8 (cbgen's) and unpadded; and the
model's other pieces (norms, MLP, rotary embedding, head and log-softmax) row by row.

`--isa avx2` (or avx512-no-bf16) runs it all with torch, oneDNN and MKL held to that instruction set and cbgen's
CPU-kind row to match (see tests/helpers.py OTHER_ISAS): one machine measuring another kind's kernels.

    python benchmarks/batch_invariance.py                    # bfloat16 where the CPU has bf16 units
    python benchmarks/batch_invariance.py --dtype float32
    python benchmarks/batch_invariance.py --dtype float32 --isa avx2
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import types

os.environ["CBGEN_RESULT_CACHE"] = "off"  # every timed run computes: the result cache would answer repeats

ISAS = {  # as tests/helpers.py OTHER_ISAS
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "CBGEN_CPU_KIND": "avx2"},
    "avx512-no-bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                       "MKL_ENABLE_INSTRUCTIONS": "AVX512", "CBGEN_CPU_KIND": "avx512"},
}


def identical(dtype: str, invariant: bool, sample: bool) -> tuple[list[tuple[int, int]], int, float]:
    """[(identical tokens, identical tokens and logprobs)] for the two other batchings, sequences, seconds."""
    import cbgen

    prompts = [f"Write a short note about topic number {i}: " + "details " * (i % 7) for i in range(16)]
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(prompts)]
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    settings = dict(num_return_sequences=2, temperature=1.0, seed=7) if sample else {}
    with cbgen.Generator(dtype=dtype, progress=False, batch_invariant=invariant) as generator:
        generator.generate(rows[:2], max_new_tokens=4)  # first-call costs, off the clock
        start = time.perf_counter()
        runs = [generator.generate(order, max_new_tokens=24, logprobs=True, **settings, **limits)
                for order, limits in ((rows, {}), (shuffled, {"max_requests_per_batch": 3}),
                                      (shuffled, {"max_batch_tokens": 40}))]
        seconds = time.perf_counter() - start
    first, *others = [{(r.id, r.sample_index): (r.token_ids, r.logprobs) for r in run} for run in runs]
    counts = [(sum(first[k][0] == other[k][0] for k in first), sum(first[k] == other[k] for k in first))
              for other in others]
    return counts, len(first), seconds


def linear_table(dtype: str) -> None:
    import torch
    import torch.nn.functional as F

    from cbgen.model.invariant import fixed_shape_linear, pack

    torch.manual_seed(0)
    rng = random.Random(0)
    kind = getattr(torch, dtype)
    x = torch.randn(700, 1536, dtype=kind)
    module = types.SimpleNamespace(bias=None)
    print(f"\nlinear shapes of SmolLM2-135M ({dtype}): rows moved of 30 random (rows, place) cases; time vs stock")
    for out_features, in_features in ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)):
        module.weight = torch.randn(out_features, in_features, dtype=kind)
        packed = pack(module.weight)  # as cbgen runs float32 tiles: over prepacked weights
        moved = {"stock": 0, "fixed": 0}
        for _ in range(30):
            count = rng.randint(1, 700)
            row = rng.randrange(count)
            rows = x[:count, :in_features]
            alone = x[row:row + 1, :in_features]
            moved["stock"] += not torch.equal(F.linear(rows, module.weight)[row], F.linear(alone, module.weight)[0])
            moved["fixed"] += not torch.equal(fixed_shape_linear(rows, module.weight, None, packed)[row],
                                              fixed_shape_linear(alone, module.weight, None, packed)[0])
        ratios = []
        for count, repeats in ((64, 20), (512, 5)):
            rows = x[:count, :in_features]
            start = time.perf_counter()
            for _ in range(repeats):
                F.linear(rows, module.weight)
            stock = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(repeats):
                fixed_shape_linear(rows, module.weight, None, packed)
            ratios.append((time.perf_counter() - start) / stock)
        print(f"  {out_features:>6} x {in_features:<5} moved: stock {moved['stock']:>2}, "
              f"fixed-shape {moved['fixed']:>2}   time: {ratios[0]:.2f}x at 64 rows, {ratios[1]:.2f}x at 512 rows")


def modules_table(dtype: str) -> None:
    """The embedded model's other row-wise pieces (under its fixed-shape tiles): a row alone against the same row
    among 1-300 others, 20 random cases each."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from cbgen.config import ModelSection
    from cbgen.model.invariant import batch_invariant_linear
    from cbgen.model.load import load_model

    model = load_model(ModelSection(dtype=dtype)).model
    layer = model.model.layers[3]
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 400, model.config.hidden_size, generator=generator).to(getattr(torch, dtype))
    positions = torch.arange(400)[None]
    heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads

    def rotary(h, p):
        cos, sin = model.model.rotary_emb(h, p)
        q = layer.self_attn.q_proj(h).view(1, h.shape[1], heads, dim).transpose(1, 2)
        return apply_rotary_pos_emb(q, q, cos, sin)[0].transpose(1, 2)

    pieces = {"RMSNorm": lambda h, p: layer.input_layernorm(h), "MLP (SiLU x up, down)": lambda h, p: layer.mlp(h),
              "rotary embedding": rotary, "final norm + head + log-softmax":
              lambda h, p: torch.log_softmax(model.lm_head(model.model.norm(h)).float(), -1)}
    print(f"\nother pieces of SmolLM2-135M ({dtype}), under the tiles: rows moved of 20 random (rows, place) cases")
    with torch.no_grad(), batch_invariant_linear(model):
        for name, piece in pieces.items():
            moved = 0
            for _ in range(20):
                count, start = rng.randint(1, 300), rng.randrange(100)
                row = rng.randrange(count)
                together = piece(x[:, start:start + count], positions[:, start:start + count])[:, row]
                alone = piece(x[:, start + row:start + row + 1], positions[:, start + row:start + row + 1])[:, 0]
                moved += not torch.equal(together, alone)
            print(f"  {name:<34} moved {moved:>2}")


def attention_table(dtype: str) -> None:
    import torch

    import cbgen.attention.invariant as invariant
    from cbgen.attention.layout import StepLayout

    kind = getattr(torch, dtype)
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(100):
        kv_heads, group, dim = rng.randint(1, 4), rng.randint(1, 5), rng.choice([16, 64, 80, 128])
        requests = []
        for _ in range(rng.randint(1, 24)):
            keys = rng.randint(1, 600)
            queries = 1 if rng.random() < 0.7 else rng.randint(1, min(keys, 64))
            requests.append((torch.randn(queries, kv_heads * group, dim, generator=generator).to(kind),
                             torch.randn(keys, kv_heads, dim, generator=generator).to(kind),
                             torch.randn(keys, kv_heads, dim, generator=generator).to(kind)))
        steps.append((requests, rng.choice([None, None, 32])))

    def attend(requests, window):
        batch = StepLayout([], [], [], [], window)
        q_at = k_at = 0
        for query, key, _ in requests:
            batch.q_starts.append(q_at)
            batch.q_lengths.append(query.shape[0])
            batch.k_starts.append(k_at)
            batch.k_lengths.append(key.shape[0])
            q_at, k_at = q_at + query.shape[0], k_at + key.shape[0]
        query = torch.cat([q for q, _, _ in requests]).transpose(0, 1).unsqueeze(0)
        out = query.new_zeros(q_at, query.shape[1], query.shape[-1])
        invariant.attend_invariant(query, torch.cat([k for _, k, _ in requests]),
                                   torch.cat([v for _, _, v in requests]), None, batch, None, out)
        return out

    print(f"\nattention ({dtype}): steps of 100 where some request gets other bits than alone; time of all 100")
    for rows in (8, 1):
        invariant.QUERY_ROWS = rows
        moved = 0
        start = time.perf_counter()
        for requests, window in steps:
            together, at = attend(requests, window), 0
            for request in requests:
                length = request[0].shape[0]
                if not torch.equal(together[at:at + length], attend([request], window)):
                    moved += 1
                    break
                at += length
        label = "padded to 8 query rows (cbgen)" if rows == 8 else "unpadded"
        print(f"  {label:<32} moved {moved:>3} of 100   {time.perf_counter() - start:.1f} s")
    invariant.QUERY_ROWS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--isa", choices=["native", *ISAS], default="native",
                        help="hold torch, oneDNN and MKL to another CPU kind's instructions")
    parser.add_argument("--sources-only", action="store_true", help="the per-source tables, without the jobs")
    args = parser.parse_args()
    if args.isa != "native" and os.environ.get("ATEN_CPU_CAPABILITY") != ISAS[args.isa]["ATEN_CPU_CAPABILITY"]:
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | ISAS[args.isa])
    import torch

    print(f"torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}"
          + (f" (held to {args.isa})" if args.isa != "native" else ""))
    if args.sources_only:
        linear_table(args.dtype)
        attention_table(args.dtype)
        modules_table(args.dtype)
        return
    print(f"16 prompts ({args.dtype}): sequences identical to the input-order run, tokens / tokens and logprobs, "
          "shuffled at --max-requests-per-batch 3 | shuffled at --max-batch-tokens 40; time of the three runs")
    for sample in (True, False):
        for invariant in (False, True):
            counts, total, seconds = identical(args.dtype, invariant, sample)
            shown = " | ".join(f"{tokens:>2}/{total} / {both:>2}/{total}" for tokens, both in counts)
            print(f"  {'seeded' if sample else 'greedy'} {'--batch-invariant' if invariant else 'stock':<18} {shown}"
                  f"   {seconds:.1f} s")
    linear_table(args.dtype)
    attention_table(args.dtype)
    modules_table(args.dtype)


if __name__ == "__main__":
    main()
