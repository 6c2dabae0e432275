"""What sampling costs per generated token against greedy decoding, side by side in one process: `cbgen bench`'s
sampling workload (64 requests for short Python functions, 128 new tokens, the embedded model) greedy, sampled at
temperature 0.8, seeded without and with batch invariance, and seeded through the draw cbgen used before (a seeded
generator and a vocabulary of Gumbel noise per row, one row at a time), patched in for the measurement only.

    python benchmarks/sampling.py
"""

from __future__ import annotations

import argparse
import hashlib


def gumbel_draw(self, scores, rows):
    """The previous draw: argmax(scores + Gumbel noise), the noise from a generator seeded by (seed, index,
    position)."""
    import torch

    chosen = []
    for i, sequence in enumerate(rows):
        if sequence.seed is None:
            sequence.seed = int(torch.randint(0, 2**62, ()).item())
        key = f"{sequence.seed}:{sequence.sample_index}:{sequence.position}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1
        generator = torch.Generator().manual_seed(seed)
        uniform = torch.rand(scores.size(1), generator=generator, dtype=torch.float64).clamp_(1e-300, 1 - 1e-16)
        noise = (-torch.log(-torch.log(uniform))).to(torch.float32)
        chosen.append(int(torch.argmax(scores[i].float() + noise)))
    return torch.tensor(chosen)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import torch

    from cbgen.bench.paths import Bench
    from cbgen.bench.workloads import BenchWorkload, build_workloads
    from cbgen.config import ModelSection
    from cbgen.control import processor
    from cbgen.model.load import load_model

    loaded = load_model(ModelSection())
    (workload,) = build_workloads(loaded.tokenizer, "small", ["sampling"])
    bench = Bench(loaded)
    rows = [(m.path, m.seconds, m.generated_tokens) for m in bench.sampling(workload)]
    new = processor.StepControl._draw
    processor.StepControl._draw = gumbel_draw  # type: ignore[method-assign]
    try:
        bench.cbgen(BenchWorkload("warm-up", workload.prompts[:8], 4), "input", invariant=False, sampling=(0.8, 1))
        m = bench.cbgen(workload, invariant=False, sampling=(0.8, 1))
        rows.append(("cbgen-seeded, Gumbel-max draw (before)", m.seconds, m.generated_tokens))
    finally:
        processor.StepControl._draw = new  # type: ignore[method-assign]
    greedy = rows[0][1] / rows[0][2]
    print(f"sampling workload: {len(workload.prompts)} requests, {workload.max_new_tokens} new tokens, "
          f"{loaded.dtype}, {torch.get_num_threads()} threads")
    for path, seconds, tokens in rows:
        print(f"  {path:<40} {seconds:6.2f} s  {tokens:>6} tokens  {tokens / seconds:7.1f} tok/s  "
              f"per-token time vs greedy {seconds / tokens / greedy:.2f}")


if __name__ == "__main__":
    main()
