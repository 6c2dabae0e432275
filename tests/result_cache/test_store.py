"""The result cache's store: an entry is whole or absent, a damaged one is a miss, many processes write at once
(some killed with SIGKILL on the way), and the least recently used entries go first when it is pruned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cbgen.cli import run_cli
from cbgen.result_cache.keys import digest
from cbgen.result_cache.store import STALE_TEMP_SECONDS, ResultStore


def key(i: int) -> str:
    return digest({"entry": i})


def test_an_entry_reads_back_as_written(tmp_path):
    store = ResultStore(tmp_path)
    assert store.get(key(1)) is None
    assert store.put(key(1), {"tokens": [1, 2, 3], "finish": "stop"})
    assert store.get(key(1)) == {"tokens": [1, 2, 3], "finish": "stop"}


@pytest.mark.parametrize("damage", ["truncated", "a flipped byte", "not json", "empty", "another key's file",
                                    "another format"])
def test_a_damaged_entry_is_a_miss_never_an_answer(tmp_path, damage):
    store = ResultStore(tmp_path)
    store.put(key(1), {"tokens": [1, 2, 3]})
    store.put(key(2), {"tokens": [7, 7, 7]})
    path = store._path(key(1))
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "a flipped byte":
        path.write_text(text.replace("[1,2,3]", "[1,2,4]"))
    elif damage == "not json":
        path.write_bytes(b"\x00\xff garbage")
    elif damage == "empty":
        path.write_text("")
    elif damage == "another key's file":
        path.write_text(store._path(key(2)).read_text())
    else:
        stored = json.loads(text)
        path.write_text(json.dumps({**stored, "payload": json.dumps({"tokens": [1, 2, 3]}), "sha256": "0" * 64}))
    assert store.get(key(1)) is None
    assert store.get(key(2)) == {"tokens": [7, 7, 7]}


WRITER = """
import os, sys
from cbgen.result_cache.keys import digest
from cbgen.result_cache.store import ResultStore
store, writer = ResultStore(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
for round in range(1000):
    for i in range(60):  # every writer writes the same keys: the last rename wins, whole
        store.put(digest({"entry": i}), {"entry": i, "writer": writer, "round": round, "pad": "x" * (i * 97)})
"""


def test_many_writers_some_killed_leave_only_whole_entries(tmp_path):
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(w)], stdout=subprocess.PIPE,
                                text=True) for w in range(4)]
    for process in writers:
        assert process.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    for process in writers[:2]:  # killed while writing, mid-entry as likely as not
        process.send_signal(signal.SIGKILL)
    time.sleep(0.5)
    store = ResultStore(tmp_path)
    for i in range(60):  # read while the others still write
        entry = store.get(key(i))
        assert entry is not None and entry["entry"] == i and entry["pad"] == "x" * (i * 97)
    for process in writers[2:]:
        process.terminate()
    for process in writers:
        process.wait(timeout=30)
    assert [p.returncode for p in writers[:2]] == [-signal.SIGKILL] * 2
    for i in range(60):
        entry = store.get(key(i))
        assert entry is not None and entry["entry"] == i and entry["writer"] in range(4)
    assert store.info().entries == 60  # temporary files of killed writers are not entries
    strays = list(store.base.glob("*/.*.tmp"))
    old = time.time() - STALE_TEMP_SECONDS - 10
    for stray in strays:
        os.utime(stray, (old, old))
    store.prune(10**12)
    assert not list(store.base.glob("*/.*.tmp")) and store.info().entries == 60


def _age(store: ResultStore, k: str, seconds_ago: float) -> None:
    when = time.time() - seconds_ago
    os.utime(store._path(k), (when, when))


def test_pruning_drops_the_least_recently_used_first(tmp_path):
    store = ResultStore(tmp_path)
    for i in range(10):
        store.put(key(i), {"entry": i, "pad": "x" * 1000})
        _age(store, key(i), 1000 - i)  # entry 0 the oldest
    assert store.get(key(0)) is not None  # a read is a use: 0 is now the newest
    size = store._path(key(0)).stat().st_size
    deleted, freed = store.prune(5 * size)
    assert deleted == 5 and freed == 5 * size
    left = {i for i in range(10) if store.get(key(i)) is not None}
    assert left == {0, 6, 7, 8, 9}
    assert store.info().entries == 5 and store.info().bytes == 5 * size


def test_the_cache_command_reports_prunes_and_clears(tmp_path, capsys):
    store = ResultStore(tmp_path)
    for i in range(4):
        store.put(key(i), {"entry": i, "pad": "x" * 2000})
        _age(store, key(i), 100 - i)
    assert run_cli(["cache", "info", "--cache", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == 4 and info["directory"] == str(Path(tmp_path).resolve())
    assert info["bytes"] == sum(store._path(key(i)).stat().st_size for i in range(4))
    assert run_cli(["cache", "prune", "--cache", str(tmp_path), "--max-size", f"{info['bytes'] // 2 + 10}B",
                    "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 2
    assert store.get(key(0)) is None and store.get(key(3)) is not None
    assert run_cli(["cache", "prune", "--cache", str(tmp_path), "--max-size", "lots"]) == 2
    assert "--max-size 'lots'" in capsys.readouterr().err
    assert run_cli(["cache", "clear", "--cache", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 2 and store.info().entries == 0
