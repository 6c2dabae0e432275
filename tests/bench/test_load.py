"""The suite's load check: a figure taken beside a busy process is flagged, one taken on a quiet machine is not, and
this process's own work (the path being timed) never counts as someone else's."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cbgen.bench import load

pytestmark = pytest.mark.quiet  # they read the machine's load: under pytest-xdist each runs alone


def _quiet_window(seconds: float, work) -> load.Watch:
    """The first of a few watched windows in which the machine was quiet before the block (a test worker's module
    fixtures may still be finishing as this test starts)."""
    for _ in range(5):
        with load.watched(before_seconds=0.3) as watch:
            work(seconds)
        if watch.before is not None and not watch.before.busy:
            return watch
    pytest.fail(f"the machine was never quiet before the window: {watch.to_dict()}")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_quiet_machine_is_not_flagged():
    watch = _quiet_window(0.8, time.sleep)
    assert watch.during is not None and not watch.during.busy, watch.to_dict()
    assert not watch.busy and watch.to_dict()["measured"]


def test_the_timed_path_own_work_is_not_counted_as_load():
    """A window in which this process keeps a core busy itself is still quiet: its CPU time is its own."""
    watch = _quiet_window(1.0, _spin)
    assert watch.during is not None
    assert watch.during.other <= load.OTHER_SHARE, watch.to_dict()
    assert not watch.busy


def test_a_busy_loop_beside_the_timed_path_is_flagged():
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        with load.watched(before_seconds=0.3) as watch:
            _spin(1.0)  # the path itself computing on one core, the neighbour on another (or the same)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert watch.before is not None and watch.during is not None
    # the neighbour kept about one core busy: its share of this process's cores is about 1 / cores
    assert watch.before.busy and watch.during.busy and watch.busy
    assert watch.during.other * watch.during.cores >= 0.5, watch.to_dict()
    assert "busy: other processes kept" in watch.during.describe()


def test_the_busiest_other_processes_are_named():
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        reading, names = load.busiest_others(0.6)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert reading is not None and reading.busy
    assert any(name.startswith(f"{neighbour.pid} python") for name in names), names
