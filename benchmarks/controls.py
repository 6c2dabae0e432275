"""What the history controls cost: the same seeded job with every control on (repetition, presence and frequency
penalties, no_repeat_ngram_size, min_p, min_tokens, logit_bias, bad words, the loop stop) and with none, on one
loaded model, runs interleaved, per generated token. Prints each run's seconds per generated token and the ratio
(goal <= 1.10).

    python benchmarks/controls.py                    # the embedded model, 32 prompts, 96 new tokens, 4 rounds
    python benchmarks/controls.py --prompts 8 --new 32 --rounds 1   # a quick check that it runs

Name the machine beside the figures (lscpu): they compare only within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import cbgen
from cbgen.bench.sections import CONTROLS  # the suite's set: every history control

TOPICS = ["rivers", "volcanoes", "bread", "chess", "owls", "trains", "glass", "tides"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    prompts = [f"Write a paragraph about {TOPICS[i % len(TOPICS)]} (note {i})." for i in range(args.prompts)]
    generator = cbgen.Generator(model=args.model)
    common = {"max_new_tokens": args.new, "temperature": 0.8, "seed": 1, "progress": False, "result_cache": False}
    per_token: dict[str, list[float]] = {"off": [], "on": []}
    generator.generate(prompts[:2], **common)  # warm-up (and the bad words' one decode of the vocabulary, 0.4 s)
    generator.generate(prompts[:2], **common, **CONTROLS)
    for _ in range(args.rounds):
        for name, extra in (("off", {}), ("on", CONTROLS)):
            start = time.perf_counter()
            rows = generator.generate(prompts, **common, **extra)
            seconds = time.perf_counter() - start
            tokens = sum(len(r.token_ids) for r in rows)
            per_token[name].append(seconds / tokens)
            reasons = {r.finish_reason for r in rows}
            print(f"{name:>3}: {tokens} tokens in {seconds:.2f} s, {1000 * seconds / tokens:.2f} ms/token, "
                  f"finish reasons {sorted(reasons)}")
    ratio = statistics.median(per_token["on"]) / statistics.median(per_token["off"])
    best = min(per_token["on"]) / min(per_token["off"])
    print(f"every control on / none, per generated token: {ratio:.3f} by the medians, {best:.3f} by the fastest "
          "runs (goal <= 1.10)")


if __name__ == "__main__":
    main()
