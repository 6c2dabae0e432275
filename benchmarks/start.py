"""Time to first token of `cbgen run`, cold (empty model cache) and warm (cache filled by the cold run).

Runs one short prompt with --max-new-tokens 1 twice, each in a fresh process, with a fresh temporary model cache,
and prints for each run the seconds from process start to: model loaded, first result written, process exit;
plus run.json's timings and cache status; and, for the warm run, the phases of that time: the seconds spent
importing (measured with `python -X importtime`, grouped by top-level package: torch, transformers, cbgen, the
rest) and the rest of each phase.

    python benchmarks/start.py                       # the embedded SmolLM2 GGUF
    python benchmarks/start.py --model some.gguf --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Runs `cbgen run` in the child, noting when the model is loaded and when the first result is written, as wall
# clock times (comparable with the parent's), by wrapping cbgen's own load_model and open_writer.
DRIVER = r"""
import json, os, sys, time

os.environ["CBGEN_RESULT_CACHE"] = "off"  # every timed run computes: the result cache would answer repeats
events = {}
def note(name):
    events.setdefault(name, time.time())
    with open(os.environ["CBGEN_START_EVENTS"], "w") as f:
        json.dump(events, f)
note("interpreter")
from cbgen.process.startup import hold_gc
hold_gc()  # as `cbgen` itself does before its heavy imports
from cbgen.cli import main
import cbgen.job.run, cbgen.engine.engine, cbgen.model.load as load, cbgen.rows.writers as writers
note("imported")
real_load = load.load_model
def load_model(*args, **kwargs):
    loaded = real_load(*args, **kwargs)
    note("model_loaded")
    return loaded
load.load_model = load_model
real_open = writers.open_writer
def open_writer(*args, **kwargs):
    writer = real_open(*args, **kwargs)
    real_write = writer.write_group
    def write_group(*a, **k):
        note("first_result")
        return real_write(*a, **k)
    writer.write_group = write_group
    return writer
writers.open_writer = open_writer
sys.argv = ["cbgen", "run", *sys.argv[1:]]
main()
"""


def import_seconds(stderr: str) -> dict[str, float]:
    """Seconds of imports by package, from `-X importtime` output: each module's own time (not the modules it
    imports in turn), added up by its top-level package (torch, transformers, cbgen, the rest)."""
    grouped: dict[str, float] = {}
    for line in stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)$", line)
        if match:
            name = match.group(2).split(".")[0]
            group = name if name in ("torch", "transformers", "cbgen") else "other"
            grouped[group] = grouped.get(group, 0.0) + int(match.group(1)) / 1e6
    return {name: round(seconds, 2) for name, seconds in sorted(grouped.items(), key=lambda kv: -kv[1])}


def run_once(label: str, work: Path, cache_dir: Path, extra: list[str]) -> dict:
    out_dir, events_file = work / f"out-{label}", work / f"events-{label}.json"
    command = [sys.executable, "-X", "importtime", "-c", DRIVER, str(work / "prompts.jsonl"), "-o", str(out_dir),
               "--max-new-tokens", "1", "--model-cache-dir", str(cache_dir), "--quiet", *extra]
    env = os.environ | {"CBGEN_START_EVENTS": str(events_file), "HF_HUB_OFFLINE": "1"}
    started = time.time()
    process = subprocess.run(command, env=env, capture_output=True, text=True)
    ended = time.time()
    if process.returncode != 0:
        sys.exit(f"{label} run failed ({process.returncode}):\n{process.stderr[-3000:]}")
    events = json.loads(events_file.read_text())
    manifest = json.loads((out_dir / "run.json").read_text())
    since = {name: round(t - started, 2) for name, t in events.items()}
    imports = import_seconds(process.stderr)
    return {"run": label, "interpreter_s": since.get("interpreter"), "imports_done_s": since.get("imported"),
            "model_loaded_s": since.get("model_loaded"), "first_result_s": since.get("first_result"),
            "exit_s": round(ended - started, 2), "cache": manifest.get("model", {}).get("cache", "n/a"),
            "run.json timings": manifest.get("timings"), "import_s": imports,
            "not_imports_s": round(ended - started - sum(imports.values()), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="--model for cbgen run (default: the embedded GGUF)")
    parser.add_argument("--dtype", help="--dtype for cbgen run")
    args = parser.parse_args()
    extra = [flag for name in ("model", "dtype") if getattr(args, name)
             for flag in (f"--{name}", getattr(args, name))]
    with tempfile.TemporaryDirectory(prefix="cbgen-start-") as folder:
        work = Path(folder)
        (work / "prompts.jsonl").write_text(json.dumps({"id": "q0", "prompt": "What is the capital of France?"})
                                            + "\n")
        for label in ("cold", "warm"):
            print(json.dumps(run_once(label, work, work / "model-cache", extra)), flush=True)


if __name__ == "__main__":
    main()
