"""The caller's idle OpenMP workers are freed while an engine runs (cbgen.engine.openmp): libgomp's pool of the thread
that warmed the manager up would otherwise make every parallel region of the generation thread wait for a sleeping
worker. Checked as the threads the process has, in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import write_jsonl

PROBE = """
import json, os, time, torch
from cbgen.engine.openmp import _pause, release_caller_pool
torch.set_num_threads(2)
count = lambda: len(os.listdir("/proc/self/task"))
before = count()
(torch.ones(4096, 64) * 2).sum()  # a parallel region: libgomp starts this thread's pool
with_pool = count()
released = release_caller_pool()
deadline = time.time() + 5
while count() >= with_pool and time.time() < deadline:
    time.sleep(0.01)
after = count()
(torch.ones(4096, 64) * 2).sum()  # a later region builds a new pool: nothing is broken
print(json.dumps(dict(found=_pause() is not None, before=before, with_pool=with_pool, released=released,
                      after=after, again=count())))
"""


def test_the_callers_idle_workers_end_and_come_back_when_needed():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if not seen["found"]:
        pytest.skip("torch's OpenMP runtime here is not libgomp: there is no pool to free")
    assert seen["with_pool"] > seen["before"]  # the region started a worker
    assert seen["released"] is True and seen["after"] < seen["with_pool"]  # and it ended
    assert seen["again"] > seen["after"]  # a later region in the caller starts one again


def test_the_engine_frees_them_after_warm_up_and_while_it_waits(tiny_model_dir, tmp_path, monkeypatch):
    """Through its scope, which owns the policy: the manager once after warm-up, the engine each time it waits; and
    each of them freed the pool (libgomp's pause was called)."""
    import cbgen.engine.openmp as openmp
    from cbgen.cli import run_cli
    from cbgen.engine.scope import EngineScope

    calls = {"start_manager": 0, "_collect": 0, "paused": 0}
    asked, paused = EngineScope.release_caller_pool, openmp.release_caller_pool

    def counted_ask(self):
        calls[sys._getframe(1).f_code.co_name] += 1
        return asked(self)

    def counted_pause():
        calls["paused"] += 1
        return paused()

    monkeypatch.setattr(EngineScope, "release_caller_pool", counted_ask)
    monkeypatch.setattr(openmp, "release_caller_pool", counted_pause)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": f"Count to {i}"} for i in range(4)])
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir),
                    "--max-new-tokens", "4", "-q"]) == 0
    assert calls["start_manager"] == 1 and calls["_collect"] >= 1
    assert calls["paused"] == calls["start_manager"] + calls["_collect"]
