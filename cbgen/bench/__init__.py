"""`cbgen bench`: cbgen's engine path against `generate_batch` and static batching, side by side, on named
workloads (workloads.py), through the paths (paths.py, listed in registry.py), reported as a table, bench.json and
bench.png (report.py). The names below load on first use, so that the torch-free parts (registry.py, the suite's
runner) import without torch."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"matmul_flops": "machine", "parameter_count": "machine", "Bench": "paths", "Measurement": "paths",
          "run_suite": "paths", "meta_for": "report", "summarise": "report", "write_outputs": "report",
          "WORDS": "workloads", "BenchWorkload": "workloads", "build_workloads": "workloads"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'cbgen.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cbgen.bench.{_HOMES[name]}"), name)
