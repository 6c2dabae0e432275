"""Small helpers shared by tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def write_jsonl(path: Path, rows: list) -> Path:
    """Writes rows (dicts, or raw strings written as they are) as JSONL."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def torchrun_cbgen(*args, processes: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m cbgen run ARGS --tp N`, one thread per process (gloo on CPU)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), "-m",
         "cbgen", "run", *map(str, args), "--tp", str(processes)],
        env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
