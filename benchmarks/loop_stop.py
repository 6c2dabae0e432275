"""The loop stop on a real job: a two-turn chat job (a question, a short answer, "go on") on the embedded model at
temperature 0.7 and 256 new tokens, run with the loop stop off and with `--loop-stop K --loop-stop-span N`, on one
loaded model. Prints, for each, the sequences cut at max_new_tokens, those the loop stop ended, the tokens generated
and the seconds.

    python benchmarks/loop_stop.py                  # 80 prompts; --loop-stop 4 and 3, --loop-stop-span 64
    python benchmarks/loop_stop.py --prompts 16 --new 64 --loop-stop 4   # a quick check that it runs

Name the machine beside the figures (lscpu): they compare only within one run.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import cbgen

TOPICS = ["rivers", "volcanoes", "bread", "chess", "owls", "trains", "glass", "tides", "maps", "bees"]


def conversation(i: int) -> dict:
    topic = TOPICS[i % len(TOPICS)]
    return {"id": str(i), "messages": [
        {"role": "user", "content": f"Tell me one fact about {topic}."},
        {"role": "assistant", "content": f"Here is one: {topic} have been studied for a very long time."},
        {"role": "user", "content": f"Go on, tell me everything else about {topic} (question {i})."}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--prompts", type=int, default=80)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--loop-stop", type=int, nargs="+", default=[4, 3],
                        help="the settings to try, each against the job without")
    parser.add_argument("--loop-stop-span", type=int, default=64)
    args = parser.parse_args()
    rows = [conversation(i) for i in range(args.prompts)]
    common = {"max_new_tokens": args.new, "temperature": 0.7, "seed": 1, "progress": False, "result_cache": False}
    with cbgen.Generator(model=args.model) as generator:
        generator.generate(rows[:2], max_new_tokens=8, progress=False)  # warm-up
        tries = [("off", {})] + [(f"--loop-stop {k} --loop-stop-span {args.loop_stop_span}",
                                  {"loop_stop": k, "loop_stop_span": args.loop_stop_span}) for k in args.loop_stop]
        for name, extra in tries:
            start = time.perf_counter()
            results = generator.generate(rows, **common, **extra)
            seconds = time.perf_counter() - start
            reasons = Counter(r.finish_reason for r in results)
            tokens = sum(len(r.token_ids) for r in results)
            saved = sum(args.new - len(r.token_ids) for r in results if r.finish_reason == "repetition")
            print(f"{name:>32}: {reasons.get('length', 0)} of {len(results)} cut at max_new_tokens, "
                  f"{reasons.get('repetition', 0)} ended by the loop stop ({saved} tokens saved); {tokens} tokens "
                  f"in {seconds:.1f} s")


if __name__ == "__main__":
    main()
