"""kill -9 in the middle of each kind of stage (generate, score, sql), then the same command again: the pipeline
finishes, each row is in each stage's output exactly once, and the final dataset holds every question once, as an
uninterrupted run makes it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cbgen.cli import run_cli
from cbgen.outputs.rundir import MANIFEST_FILE
from tests.pipelines.helpers import QUERY, ids, write_pipeline

ROWS = 24
# a query that takes a few seconds (the sum is positive, so it filters nothing), so it can be killed while it runs
SLOW = QUERY.replace("FROM judge", "FROM judge WHERE (SELECT sum(hash(i) % 7) FROM range(400000000) t(i)) >= 0")


def start(file: Path, out: Path) -> tuple[subprocess.Popen, list[str]]:
    process = subprocess.Popen([sys.executable, "-m", "cbgen", "pipeline", str(file), "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    assert process.stderr is not None
    threading.Thread(target=lambda: lines.extend(process.stderr or ()), daemon=True).start()
    return process, lines


def midway(out: Path, stage: str, kind: str, lines: list[str]) -> bool:
    """Whether `stage` has begun and not finished: some of its rows committed, its run not complete."""
    if kind == "sql":
        return any(f"stage '{stage}' (sql): running" in line for line in lines)
    manifest = out / stage / MANIFEST_FILE
    return bool(list((out / stage).glob("part-*.parquet"))) and (
        not manifest.exists() or '"status": "complete"' not in manifest.read_text())


def final(out: Path) -> dict[str, str]:
    rows = pq.read_table(out / "kept" / "part-00000.parquet").to_pylist()
    assert sorted(r["question_id"] for r in rows) == [str(i) for i in sorted(range(ROWS), key=str)]
    return {r["question_id"]: r["answer"] for r in rows}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    file = write_pipeline(folder, tiny_model_dir, rows=ROWS, query=SLOW, judge={"batch_tokens": 64})
    assert run_cli(["pipeline", str(file), "-o", str(folder / "out"), "-q"]) == 0
    return final(folder / "out")


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "kind"), [("answers", "generate"), ("judge", "score"), ("kept", "sql")])
def test_kill_9_mid_stage_then_the_same_command_finishes_each_row_once(tiny_model_dir, tmp_path, reference,
                                                                        stage, kind):
    file = write_pipeline(tmp_path, tiny_model_dir, rows=ROWS, query=SLOW, judge={"batch_tokens": 64})
    out = tmp_path / "out"
    process, lines = start(file, out)
    deadline = time.monotonic() + 300
    while not midway(out, stage, kind, lines):
        assert process.poll() is None, f"the pipeline ended before {stage} was caught mid-way: {lines[-5:]}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if kind == "sql":
        time.sleep(0.5)  # inside the query
    process.kill()
    process.wait()
    if kind != "sql":
        assert '"status": "complete"' not in (out / stage / MANIFEST_FILE).read_text() \
            if (out / stage / MANIFEST_FILE).exists() else True
    else:
        assert not (out / "kept" / "part-00000.parquet").exists()  # no half of a result
    assert run_cli(["pipeline", str(file), "-o", str(out), "-q"]) == 0
    for name, expected in (("questions", ROWS), ("answers", 2 * ROWS), ("judge", 2 * ROWS)):
        counts = ids(out / name)
        assert len(counts) == expected and set(counts.values()) == {1}, name  # every row, each once
    assert final(out) == reference  # as an uninterrupted run makes it
    assert run_cli(["status", str(out)]) == 0
