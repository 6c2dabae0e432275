"""Where a sequence's tokens move with its batch, measured: the groundwork of batch-invariant numerics.

The same 16 prompts (-n 2, temperature 1, seed 7, 24 new tokens; and greedy) are generated twice on the embedded
model: in input order with no batch limit, then shuffled with --max-requests-per-batch 3. The script counts the
sequences whose tokens, and whose tokens and logprobs, are bitwise the same, in four variants patched into the loaded
model for the measurement only (cbgen itself is unchanged):

    stock        cbgen as it is
    linear       every nn.Linear as fixed-shape calls: the rows zero-padded to a multiple of 32 and multiplied 32
                 at a time, so the BLAS sees one shape whatever the batch (its kernel choice, and a tail tile's other
                 kernel, otherwise follow the row count)
    attention    single-token (decode) attention one request at a time over its own keys, instead of all of them in
                 one SDPA call padded to the longest and masked
    both         the two together

Then, per linear shape of the model, whether a row's result moves with the number of rows and its place among them
(30 random cases), stock and fixed-shape, and the fixed-shape calls' time against one stock call at 64 and 512 rows.

    python benchmarks/batch_invariance.py                    # bfloat16 where the CPU has bf16 units
    python benchmarks/batch_invariance.py --dtype float32
"""

from __future__ import annotations

import argparse
import random
import time
import types

ROWS = 32  # rows per fixed-shape call


def fixed_shape_forward(self, x):
    """nn.Linear's forward as fixed-shape matmuls of ROWS rows (the tail zero-padded)."""
    import torch

    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    count = rows.shape[0]
    padded = -(-count // ROWS) * ROWS
    source = rows.new_zeros(padded, rows.shape[1])
    source[:count] = rows
    out = rows.new_empty(padded, self.weight.shape[0])
    for start in range(0, padded, ROWS):
        torch.mm(source[start:start + ROWS], self.weight.t(), out=out[start:start + ROWS])
    result = out[:count]
    if self.bias is not None:
        result = result + self.bias
    return result.reshape(*shape[:-1], self.weight.shape[0])


def one_request_at_a_time(real):
    """SDPA for decode queries ([requests, heads, <=3, dim]) one request at a time over its own keys."""
    import torch

    def attention(q, k, v, attn_mask=None, **kwargs):
        if q.shape[0] > 1 and q.shape[2] <= 3 and not kwargs.get("is_causal"):
            outs = []
            for b in range(q.shape[0]):
                n = int(attn_mask[b, 0, 0].sum()) if attn_mask is not None else k.shape[2]
                outs.append(real(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], **kwargs))
            return torch.cat(outs)
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    return attention


def identical(dtype: str, variant: str, sample: bool) -> tuple[int, int, int, float]:
    import torch
    import torch.nn.functional as F

    import cbgen
    import cbgen.attention.per_sequence as per_sequence

    prompts = [f"Write a short note about topic number {i}: " + "details " * (i % 7) for i in range(16)]
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(prompts)]
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    settings = dict(num_return_sequences=2, temperature=1.0, seed=7) if sample else {}
    real = F.scaled_dot_product_attention
    if variant in ("attention", "both"):
        per_sequence.F = types.SimpleNamespace(scaled_dot_product_attention=one_request_at_a_time(real))
    try:
        with cbgen.Generator(dtype=dtype, progress=False) as generator:
            if variant in ("linear", "both"):
                for module in generator.loaded.model.modules():
                    if type(module) is torch.nn.Linear:
                        vars(module)["forward"] = types.MethodType(fixed_shape_forward, module)
            generator.generate(rows[:2], max_new_tokens=4)  # first-call costs, off the clock
            start = time.perf_counter()
            a = generator.generate(rows, max_new_tokens=24, logprobs=True, **settings)
            b = generator.generate(shuffled, max_new_tokens=24, logprobs=True, max_requests_per_batch=3, **settings)
            seconds = time.perf_counter() - start
    finally:
        per_sequence.F = F
    first = {(r.id, r.sample_index): (r.token_ids, r.logprobs) for r in a}
    second = {(r.id, r.sample_index): (r.token_ids, r.logprobs) for r in b}
    return (sum(first[k][0] == second[k][0] for k in first), sum(first[k] == second[k] for k in first), len(first),
            seconds)


def linear_table(dtype: str) -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    rng = random.Random(0)
    kind = getattr(torch, dtype)
    x = torch.randn(700, 1536, dtype=kind)
    module = types.SimpleNamespace(bias=None)
    print(f"\nlinear shapes of SmolLM2-135M ({dtype}): rows moved of 30 random (rows, place) cases; time vs stock")
    for out_features, in_features in ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)):
        module.weight = torch.randn(out_features, in_features, dtype=kind)
        moved = {"stock": 0, "fixed": 0}
        for _ in range(30):
            count = rng.randint(1, 700)
            row = rng.randrange(count)
            rows = x[:count, :in_features]
            alone = x[row:row + 1, :in_features]
            moved["stock"] += not torch.equal(F.linear(rows, module.weight)[row], F.linear(alone, module.weight)[0])
            moved["fixed"] += not torch.equal(fixed_shape_forward(module, rows)[row],
                                              fixed_shape_forward(module, alone)[0])
        ratios = []
        for count, repeats in ((64, 20), (512, 5)):
            rows = x[:count, :in_features]
            start = time.perf_counter()
            for _ in range(repeats):
                F.linear(rows, module.weight)
            stock = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(repeats):
                fixed_shape_forward(module, rows)
            ratios.append((time.perf_counter() - start) / stock)
        print(f"  {out_features:>6} x {in_features:<5} moved: stock {moved['stock']:>2}, "
              f"fixed-shape {moved['fixed']:>2}   time: {ratios[0]:.2f}x at 64 rows, {ratios[1]:.2f}x at 512 rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    print(f"16 prompts, in order against shuffled with --max-requests-per-batch 3 ({args.dtype}): identical "
          "tokens / identical tokens and logprobs, and the time of the two generations")
    for sample in (True, False):
        for variant in ("stock", "linear", "attention", "both"):
            tokens, both, total, seconds = identical(args.dtype, variant, sample)
            print(f"  {'seeded' if sample else 'greedy'} {variant:<10} {tokens:>2}/{total} / {both:>2}/{total}"
                  f"   both generations {seconds:.1f} s")
    linear_table(args.dtype)


if __name__ == "__main__":
    main()
