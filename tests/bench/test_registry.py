"""`cbgen bench`'s paths are listed once (cbgen.bench.registry): the command's choices are that list, and the bench
runs each listed path through the timing the list names for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cbgen.bench import paths
from cbgen.bench.registry import BENCH_PATHS
from cbgen.bench.workloads import BenchWorkload, Measurement
from cbgen.errors import CbgenError


class Recorder:
    """A Bench that records which timing ran each path, and with what."""

    def __init__(self, *args) -> None:
        self.calls: list[tuple] = []
        Recorder.last = self

    def _m(self, workload, path):
        return Measurement(workload.name, path, 1.0, 1, 1, 1, {})

    def cbgen(self, workload, order):
        self.calls.append(("cbgen", order))
        return self._m(workload, {"gated": "cbgen", "ordered": "cbgen-ordered", "input": "cbgen-input-order"}[order])

    def variant(self, workload, path, earlier):
        self.calls.append(("variant", path, BENCH_PATHS[path].settings))
        return [self._m(workload, path)]

    def generate_batch(self, workload):
        self.calls.append(("generate_batch",))
        return self._m(workload, "generate_batch")

    def static(self, workload, size):
        self.calls.append(("static", size))
        return self._m(workload, f"static-{size}")

    def llamacpp(self, workload, gguf, parallel, reference, path):
        self.calls.append(("llamacpp", path, gguf.name))
        return self._m(workload, path)


def test_each_listed_path_runs_through_the_timing_the_list_names(monkeypatch):
    monkeypatch.setattr(paths, "Bench", Recorder)
    workload = BenchWorkload("w", [[1, 2, 3]], 2)
    measured = paths.run_suite(None, [workload], list(BENCH_PATHS), static_batch_sizes=(8,),
                               llamacpp_model=Path("f32.gguf"), llamacpp_quantized=Path("q8.gguf"))
    calls = Recorder.last.calls[1:]  # after the warm-up's cbgen call
    assert [m.path for m in measured] == [name if name != "static" else "static-8" for name in BENCH_PATHS]
    assert calls[:3] == [("cbgen", "gated"), ("cbgen", "ordered"), ("cbgen", "input")]
    variants = [c for c in calls if c[0] == "variant"]
    assert [c[1] for c in variants] == [n for n, p in BENCH_PATHS.items() if p.runs == "variant"]
    assert all(c[2] for c in variants)  # each changes a setting
    assert ("llamacpp", "llamacpp", "f32.gguf") in calls and ("llamacpp", "llamacpp-q8_0", "q8.gguf") in calls
    with pytest.raises(CbgenError, match=r"the llamacpp-q8_0 path needs the GGUF file llama.cpp runs "
                                         r"\(--llamacpp-q8-model\)"):
        paths.run_suite(None, [workload], ["llamacpp-q8_0"], llamacpp_model=Path("f32.gguf"))


def test_the_commands_choices_are_the_list_and_name_no_torch():
    code = ("import sys; from cbgen.cli import bench_cmd; from cbgen.bench.registry import BENCH_PATHS; "
            "assert bench_cmd.PATHS == tuple(BENCH_PATHS); assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
