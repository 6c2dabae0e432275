"""Hostile inputs against `cbgen run`: wall time, peak RSS and exit code of each, in fresh processes.

The cases: a row nested 100,000 arrays deep, a 60 MB prompt line, 150 KB of binary garbage as .jsonl, and a
truncated .jsonl.gz, each (but the last two) between good rows; plus the same good rows alone, for the baseline the
extra RSS is measured against. Runs the embedded model with --max-new-tokens 4 unless --model says otherwise.

    python benchmarks/hostile.py                    # cbgen as installed
    PYTHONPATH=/path/to/other/checkout python benchmarks/hostile.py   # another version, for before/after
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["CBGEN_RESULT_CACHE"] = "off"  # every timed run computes: the result cache would answer repeats

GOOD = [json.dumps({"prompt": "What is the capital of France?"}), json.dumps({"prompt": "Name a colour."})]


def cases(folder: Path) -> dict[str, Path]:
    made = {}

    def jsonl(name: str, middle: list[str] | None) -> None:
        path = folder / f"{name}.jsonl"
        path.write_text("\n".join([GOOD[0], *(middle or []), GOOD[1]]) + "\n")
        made[name] = path

    jsonl("good rows only", None)
    jsonl("100,000-deep nesting", ['{"id": "deep", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    jsonl("60 MB prompt line", [json.dumps({"prompt": "lorem ipsum " * 5_000_000})])
    rng = random.Random(0)
    garbage = folder / "150 KB binary garbage.jsonl"
    garbage.write_bytes(bytes(rng.randrange(256) for _ in range(150_000)))
    made["150 KB binary garbage"] = garbage
    truncated = folder / "truncated.jsonl.gz"
    data = gzip.compress(("\n".join(GOOD * 1000) + "\n").encode())
    truncated.write_bytes(data[: len(data) // 2])
    made["truncated .jsonl.gz"] = truncated
    return made


def run(path: Path, out: Path, extra: list[str]) -> dict:
    command = [sys.executable, "-c", "from cbgen.cli import main; main()", "run", str(path), "-o", str(out),
               "--max-new-tokens", "4", "-q", *extra]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=os.environ | {"HF_HUB_OFFLINE": "1"})
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    err = process.stderr.read().decode(errors="replace").strip().splitlines()
    rows = sum(1 for p in out.glob("part-*.jsonl") for _ in p.open()) if out.is_dir() else 0
    return {"exit": os.waitstatus_to_exitcode(status), "seconds": round(seconds, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024), "rows": rows, "stderr": err[-1][:160] if err else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="--model for cbgen run (default: the embedded GGUF)")
    args = parser.parse_args()
    extra = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory(prefix="cbgen-hostile-") as tmp:
        folder = Path(tmp)
        baseline = None
        for name, path in cases(folder).items():
            result = run(path, folder / f"out-{len(name)}-{abs(hash(name))}", extra)
            baseline = baseline or result["peak_rss_mb"]
            result["extra_rss_mb"] = result["peak_rss_mb"] - baseline
            print(json.dumps({"case": name, **result}), flush=True)


if __name__ == "__main__":
    main()
