"""--data-parallel on this machine: one process with all the cores against N replicas with their share each, on
`cbgen bench`'s workloads (the same prompts, as token ids, and the same per-request caps), through `cbgen run`.

    python benchmarks/data_parallel.py [--workloads mixed,many-small] [--replicas 2] [--size small]

Prints, per workload, the generation time (run.json's generation_s: model load excluded) and tokens/s of each, and
the ratio. Greedy, so both write the same tokens (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["CBGEN_RESULT_CACHE"] = "off"  # every timed run computes: the result cache would answer repeats


def rows_of(workload) -> list[dict]:
    return [{"id": f"{workload.name}-{i}", "input_ids": ids, "max_new_tokens": workload.cap(i)}
            for i, ids in enumerate(workload.prompts)]


def run(path: Path, out: Path, replicas: int, model: str | None) -> dict:
    args = [sys.executable, "-m", "cbgen", "run", str(path), "-o", str(out), "-q", "--overwrite",
            "--data-parallel", str(replicas)] + (["--model", model] if model else [])
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    manifest = json.loads((out / "run.json").read_text())
    tokens = {}
    for shard in sorted(out.glob("part-*.jsonl")):
        for line in shard.read_text().splitlines():
            row = json.loads(line)
            tokens[row["id"]] = row["token_ids"]
    return {"seconds": manifest["timings"]["generation_s"], "total": manifest["timings"]["total_s"], "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="mixed,many-small")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--size", default="small")
    parser.add_argument("--model", default=None, help="As for cbgen run. Default: the embedded SmolLM2.")
    args = parser.parse_args()

    from cbgen.bench import build_workloads
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    tokenizer = load_model(ModelSection(model=args.model)).tokenizer
    print(f"{os.cpu_count()} CPUs; 1 process x {len(os.sched_getaffinity(0))} threads against {args.replicas} "
          "replicas with their share each")
    print("generation s (from the first request to the last result; the replicas' own model loads are in it) and, "
          "in brackets, the whole command's s")
    print(f"{'workload':<12} {'requests':>8} {'1 process':>16} {f'{args.replicas} replicas':>16} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as folder:
        for workload in build_workloads(tokenizer, args.size, args.workloads.split(",")):
            path = Path(folder) / f"{workload.name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows_of(workload)))
            one = run(path, Path(folder) / "one", 1, args.model)
            many = run(path, Path(folder) / "many", args.replicas, args.model)
            same = "same tokens" if one["tokens"] == many["tokens"] else "TOKENS DIFFER"
            print(f"{workload.name:<12} {len(workload.prompts):>8} {one['seconds']:>7.1f} ({one['total']:>6.1f}) "
                  f"{many['seconds']:>7.1f} ({many['total']:>6.1f}) {one['seconds'] / many['seconds']:>6.2f}  ({same})")


if __name__ == "__main__":
    main()
