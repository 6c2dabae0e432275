"""`cbgen bench`: cbgen's engine path against `generate_batch` and static batching, side by side, on named
workloads (workloads.py), through the paths (paths.py), reported as a table, bench.json and bench.png (report.py)."""

from cbgen.bench.machine import matmul_flops, parameter_count
from cbgen.bench.paths import Bench, Measurement, run_suite
from cbgen.bench.report import meta_for, summarise, write_outputs
from cbgen.bench.workloads import WORDS, BenchWorkload, build_workloads

__all__ = ["WORDS", "Bench", "BenchWorkload", "Measurement", "build_workloads", "matmul_flops", "meta_for",
           "parameter_count", "run_suite", "summarise", "write_outputs"]
