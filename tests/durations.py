"""The suite's files in the order pytest-xdist should hand them out: the longest first, so that the two workers
finish together instead of one running a long file alone at the end (longest-first is within 4/3 of the best
split). `--dist loadfile` gives a worker whole files in collection order once `--no-loadscope-reorder` keeps that
order (its default reorders by the number of tests, which puts the long single-test files last).

Each file's seconds come from `durations.json` beside this module (a whole run's JUnit report, summed per file);
a file it does not know yet weighs a second per test and ten per slow or embedded test. Refresh it after the suite
changes shape:

    .venv/bin/python -m pytest -n auto --dist loadfile --junitxml=/tmp/junit.xml
    .venv/bin/python -m tests.durations /tmp/junit.xml
"""

from __future__ import annotations

import json
import os
import platform
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any

DURATIONS = Path(__file__).with_name("durations.json")
_SLOW_MARKS = ("slow", "embedded")


def _guess(items: list[Any]) -> float:
    return sum(10.0 if any(item.get_closest_marker(mark) for mark in _SLOW_MARKS) else 1.0 for item in items)


def longest_first(items: list[Any]) -> list[Any]:
    """`items` grouped by file, the files ordered by their known (or guessed) seconds, longest first; the tests of a
    file keep their order."""
    known = json.loads(DURATIONS.read_text())["seconds"] if DURATIONS.exists() else {}
    files: dict[str, list[Any]] = defaultdict(list)
    for item in items:
        files[item.nodeid.split("::", 1)[0]].append(item)
    weight = {name: known.get(name, _guess(tests)) for name, tests in files.items()}
    return [item for name in sorted(files, key=lambda name: -weight[name]) for item in files[name]]


def _machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def write(junit: Path) -> dict[str, float]:
    """Sums a JUnit report's test times per file and writes them to durations.json."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).iter("testcase"):
        seconds[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time") or 0)
    ordered = {name: round(value, 1) for name, value in sorted(seconds.items(), key=lambda kv: -kv[1])}
    DURATIONS.write_text(json.dumps({"machine": _machine(), "seconds": ordered}, indent=1) + "\n")
    return ordered


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.durations JUNIT_XML")
    written = write(Path(sys.argv[1]))
    print(f"{DURATIONS}: {len(written)} files, {sum(written.values()):.0f} s in all")
