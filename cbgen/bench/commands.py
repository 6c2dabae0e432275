"""The suite's whole-command paths: a warm start (`cbgen run` of one prompt and one token, in a fresh process, after
a first run filled the caches: the converted model, the compiled kernels) and `--help`, each timed from process start
to exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _run(command: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True,
                          env=os.environ | {"CBGEN_RESULT_CACHE": "off", "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:5])} ... failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return seconds


def start_paths(folder: Path, model: str | None) -> dict[str, Callable[[], float]]:
    """Path name -> a call that runs the command once and returns its seconds; the warm start's first run is made
    here, off the clock."""
    prompts = folder / "one-prompt.jsonl"
    prompts.write_text(json.dumps({"id": "q0", "prompt": "What is the capital of France?"}) + "\n")
    cbgen = [sys.executable, "-m", "cbgen"]
    run = [*cbgen, "run", str(prompts), "-o", str(folder / "start-out"), "--max-new-tokens", "1", "--overwrite",
           "-q", *(["--model", model] if model else [])]
    _run(run)  # the cold run: what it converts and builds, the warm ones find
    return {"warm start (one prompt, one token)": lambda: _run(run), "cbgen --help": lambda: _run([*cbgen, "--help"]),
            "cbgen run --help": lambda: _run([*cbgen, "run", "--help"])}
