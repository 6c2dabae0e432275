"""The result cache, measured on the embedded model (docs/cache.md):

    python benchmarks/result_cache.py [--rows 1000] [--max-new-tokens 16] [--model PATH]

1. the cache's cost on a first run: the same job with `--no-cache` and with an empty cache, alternating
   (`--repeats`, the fastest of each compared; goal: at most 3 % more generation time);
2. the second run of that job into a new directory, answered from the cache (goal: at least 50x faster, whole
   command against whole command, and generation phase against generation phase);
3. a pipeline (questions -> answers -> judge) rerun after its first stage's template changed for a tenth of its
   rows (goal: only those rows and their descendants computed), and its stages equal to a fresh run of the changed
   pipeline.

Seeded sampling, so the jobs are batch-invariant (the default for seeded CPU jobs) and the cache's hits are exact;
the pipeline sets `batch_invariant: true` for its judge too (a score stage's hits are exact only where each row is
scored on its own).
Each command runs as a user would run it (`python -m cbgen ...` in a new process); the figures are its wall time
and run.json's own timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

TOPICS = ["rivers", "bread", "comets", "violins", "tides", "moss", "glass", "owls", "copper", "maps", "salt", "kites",
          "ferns", "clocks", "bees", "lenses", "wool", "dunes", "bells", "ink"]


VOLATILE = {"timing", "latency_s", "finished_at"}  # row fields that differ between two equal runs, if any


def prompts(n: int) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"Write one short sentence about {TOPICS[i % len(TOPICS)]} (note {i})."}
            for i in range(n)]


def cbgen(args: list[str]) -> float:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cbgen", *args, "-q"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"cbgen {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def manifest(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def rows(out: Path) -> dict:
    found = {}
    for shard in sorted(out.glob("part-*.jsonl")):
        for line in shard.read_text().splitlines():
            row = json.loads(line)
            found[(row["id"], row.get("sample_index", 0))] = {k: v for k, v in row.items() if k not in VOLATILE}
    return found


def job_runs(folder: Path, n: int, tokens: int, model: list[str], repeats: int) -> None:
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in prompts(n)))
    cache = folder / "cache"
    common = ["run", str(data), "--seed", "7", "--temperature", "0.8", "--max-new-tokens", str(tokens),
              "--logprobs", "--overwrite", *model]
    figures: dict[str, dict] = {}
    runs = [("no cache", ["--no-cache"]), ("empty cache", ["--cache", str(cache)])] * repeats
    runs.append(("cached", ["--cache", str(cache)]))
    for i, (name, extra) in enumerate(runs):
        if name == "empty cache" and cache.exists():
            shutil.rmtree(cache)  # each first run starts from an empty cache; the last one's fills it
        out = folder / f"{i}-{name.replace(' ', '-')}"
        wall = cbgen([*common, "-o", str(out), *extra])
        m = manifest(out)
        run = {"wall": wall, "generation": m["timings"].get("generation_s", 0.0),
               "load": m["timings"].get("model_load_s", 0.0), "cache": m.get("result_cache", {}), "rows": rows(out)}
        print(f"  {name:12s} whole command {wall:7.2f} s   generation {run['generation']:7.2f} s   "
              f"model load {run['load']:5.2f} s   result cache hits {run['cache'].get('hits', '-')}, "
              f"misses {run['cache'].get('misses', '-')}")
        best = figures.get(name)
        if best is not None:
            assert best["rows"] == run["rows"], "two runs of one job must write the same tokens and logprobs"
        if best is None or run["generation"] < best["generation"]:
            figures[name] = run
    first, second, off = figures["empty cache"], figures["cached"], figures["no cache"]
    assert first["rows"] == second["rows"] == off["rows"], "the three runs must write the same tokens and logprobs"
    print(f"  same tokens and logprobs in all three runs: {len(first['rows'])} sequences")
    print(f"  first run's cost of the cache: generation {first['generation'] / off['generation'] - 1:+.1%}, "
          f"whole command {first['wall'] / off['wall'] - 1:+.1%} (goal <= +3 %)")
    print(f"  second run into a new directory: {first['wall'] / second['wall']:.1f}x faster, whole command; "
          f"{first['generation'] / max(second['generation'], 1e-3):.0f}x, generation phase (goal >= 50x)")


def pipeline_spec(folder: Path, n: int, tokens: int, model: str | None, changed: bool) -> Path:
    seeds = folder / "topics.jsonl"
    seeds.write_text("".join(json.dumps({"id": f"t{i}", "topic": TOPICS[i % len(TOPICS)], "n": i}) + "\n"
                             for i in range(n)))
    question = "Ask one question about {{ topic }} (number {{ n }})."
    if changed:  # a tenth of the rows get a new template; the others render exactly as before
        question = ("{% if n % 10 == 0 %}Ask one odd question about {{ topic }} (number {{ n }}).{% else %}"
                    + question + "{% endif %}")
    spec = {
        "defaults": {"seed": 7, "batch_invariant": True, "temperature": 0.8, "max_new_tokens": tokens,
                     "cache": str(folder / "pcache"),
                     **({"model": model} if model else {})},
        "stages": [
            {"name": "questions", "kind": "generate", "input": str(seeds), "template": question},
            {"name": "answers", "kind": "generate", "input": "questions", "template": "{{ questions.text }}"},
            {"name": "judge", "kind": "score", "input": "answers", "choices": ["1", "2", "3", "4", "5"],
             "template": "Question: {{ questions.text }}\nAnswer: {{ answers.text }}\nScore from 1 to 5:"},
        ],
    }
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def pipeline_runs(folder: Path, n: int, tokens: int, model: str | None) -> None:
    out = folder / "pipe"
    wall = cbgen(["pipeline", str(pipeline_spec(folder, n, tokens, model, changed=False)), "-o", str(out)])
    print(f"  first run {wall:.1f} s")
    wall = cbgen(["pipeline", str(pipeline_spec(folder, n, tokens, model, changed=True)), "-o", str(out)])
    print(f"  rerun after the questions' template changed for {n // 10} of {n} rows: {wall:.1f} s")
    for stage in ("questions", "answers", "judge"):
        cache = manifest(out / stage).get("result_cache", {})
        print(f"    {stage:10s} hits {cache.get('hits')}  misses (computed) {cache.get('misses')}")
    fresh = folder / "pipe-fresh"
    spec = pipeline_spec(folder, n, tokens, model, changed=True)
    data = yaml.safe_load(spec.read_text())
    data["defaults"]["result_cache"] = False
    del data["defaults"]["cache"]
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    cbgen(["pipeline", str(spec), "-o", str(fresh)])
    same = all(rows(out / stage) == rows(fresh / stage) for stage in ("questions", "answers", "judge"))
    print(f"  every stage equal to a fresh run of the changed pipeline: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="First runs of each kind, alternating (the fastest "
                        "of each is compared)")
    parser.add_argument("--pipeline-rows", type=int, default=100)
    parser.add_argument("--model", default=None, help="As for cbgen run. Default: the embedded SmolLM2.")
    args = parser.parse_args()
    from cbgen.config.cpu import cpu_model

    print(f"{cpu_model()}, {len(os.sched_getaffinity(0))} threads")
    model = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory(prefix="cbgen-cache-bench-") as tmp:
        print(f"{args.rows} rows x {args.max_new_tokens} new tokens, seeded sampling, logprobs:")
        job_runs(Path(tmp), args.rows, args.max_new_tokens, model, args.repeats)
        print(f"pipeline over {args.pipeline_rows} topics (questions -> answers -> judge):")
        pipeline_runs(Path(tmp), args.pipeline_rows, args.max_new_tokens, args.model)


if __name__ == "__main__":
    main()
