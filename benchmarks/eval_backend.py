"""`lm_eval --model cbgen` against `--model hf` on the same weights, side by side in one process (docs/evaluation.md):

    python benchmarks/eval_backend.py [--hf-batch-sizes 1,8] [--dtype float32] [--limit N] [--tasks ...]

Both models are loaded once (the embedded SmolLM2-135M: cbgen from its GGUF, hf from the float32 safetensors cbgen
converted it into), then each task of examples/eval is evaluated by each, timed from the first request to the
results (model load excluded; each backend first runs each task on two rows, untimed, so that lm-eval's dataset
preparation and each backend's first-call set-up are not in the figures). Prints each task's time and metric per
backend, and checks the answers: the largest loglikelihood difference and whether is_greedy agrees everywhere
(multiple choice, rolling), and whether the greedy generations are identical (generative, with lm-eval's
--apply_chat_template: the embedded model is an instruct model, which answers a bare prompt with its end token).
Run from anywhere; the tasks' data is found from the repository root.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"cbgen_capitals": "acc,none", "cbgen_arithmetic": "exact_match,first_number",
         "cbgen_texts": "word_perplexity,none"}
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["CBGEN_RESULT_CACHE"] = "off"  # every timed run computes


CHAT = {"cbgen_arithmetic"}  # an instruct model answers a bare prompt with its end token: the chat template on


def run(lm, task: str, limit: int | None, manager) -> tuple[float, dict]:
    import lm_eval

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=limit, log_samples=True, task_manager=manager,
                                      apply_chat_template=task in CHAT)
    return time.perf_counter() - start, results


def answers(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def compare(ours: list, theirs: list) -> str:
    gap, greedy_same, same_text = 0.0, True, True
    for a, b in zip(ours, theirs, strict=True):
        for (x,), (y,) in zip(a, b, strict=True):
            if isinstance(x, str):
                same_text &= x == y
            elif isinstance(x, tuple):
                gap = max(gap, abs(x[0] - y[0]))
                greedy_same &= x[1] == y[1]
            else:
                gap = max(gap, abs(x - y))
    if isinstance(ours[0][0][0], str):
        empty = sum(not a[0][0] for a in ours)
        return f"generations identical: {same_text} ({empty} of {len(ours)} empty)"
    return f"largest loglikelihood gap {gap:.2e}, is_greedy the same: {greedy_same}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-batch-sizes", default="1,8", help="--model hf's --batch_size values to time")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--limit", type=int, default=None, help="Rows per task (default: all)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="Which of the example tasks")
    args = parser.parse_args()
    os.chdir(ROOT)  # the tasks' data_files are relative to the repository root

    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from cbgen.config.cpu import cpu_model, cpu_row
    from cbgen.evaluation.lm import CbgenLM
    from cbgen.model.gguf import TOKENIZER_ENTRY, GgufCache, default_cache_dir, model_entry
    from cbgen.model.source import embedded_model_path

    print(f"{cpu_model()} ({cpu_row().kind}), {len(os.sched_getaffinity(0))} threads, torch {torch.__version__}, "
          f"{args.dtype}")
    manager = TaskManager(include_path=str(ROOT / "examples" / "eval"))
    ours = CbgenLM(dtype=args.dtype)
    cache = GgufCache(default_cache_dir(), embedded_model_path())
    folder = cache.find(model_entry(getattr(torch, args.dtype)))
    if folder is None:
        raise SystemExit(f"no {args.dtype} copy of the embedded model converted yet: run cbgen once with --dtype "
                         f"{args.dtype}")
    reference = {size: HFLM(pretrained=str(folder), tokenizer=str(cache.find(TOKENIZER_ENTRY)), dtype=args.dtype,
                            device="cpu", batch_size=int(size))
                 for size in args.hf_batch_sizes.split(",")}
    tasks = {task: TASKS[task] for task in args.tasks.split(",")}
    for task in tasks:  # lm-eval prepares a task's dataset on its first use: not timed, for either backend
        for lm in (ours, *reference.values()):
            run(lm, task, 2, manager)
    print(f"{'task':18s} {'backend':12s} {'seconds':>8s} {'metric':>10s}  hf ÷ cbgen")
    for task, metric in tasks.items():
        seconds, mine = run(ours, task, args.limit, manager)
        print(f"{task:18s} {'cbgen':12s} {seconds:8.1f} {mine['results'][task][metric]:10.4f}")
        for size, hf in reference.items():
            hf_seconds, theirs = run(hf, task, args.limit, manager)
            print(f"{task:18s} {'hf, batch ' + size:12s} {hf_seconds:8.1f} {theirs['results'][task][metric]:10.4f}  "
                  f"{hf_seconds / seconds:5.2f}x   {compare(answers(mine, task), answers(theirs, task))}")


if __name__ == "__main__":
    main()
