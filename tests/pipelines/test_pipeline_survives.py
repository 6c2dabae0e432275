"""kill -9 in the middle of each kind of stage (generate, score, sql), then the same command again: the killed stage
resumes (generate, score: from its committed rows) or runs again (sql: no half of a result was kept), the stages
before it are not run again, the pipeline finishes, each row is in each stage's output exactly once, and the final
dataset holds every question once, as an uninterrupted run makes it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import cbgen
from cbgen.cli import run_cli
from cbgen.rows.rundir import MANIFEST_FILE
from tests.pipelines.helpers import QUERY, ids, write_pipeline

ROWS = 24
# a query that takes a few seconds (the sum is positive, so it filters nothing), so it can be killed while it runs:
# the sql stage's kill test alone runs it (twice: killed, then again); the others, and the uninterrupted reference,
# keep the same rows with QUERY in a fraction of a second
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


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def final(out: Path) -> dict[str, str]:
    rows = pq.read_table(out / "kept" / "part-00000.parquet").to_pylist()
    assert sorted(r["question_id"] for r in rows) == [str(i) for i in sorted(range(ROWS), key=str)]
    return {r["question_id"]: r["answer"] for r in rows}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    file = write_pipeline(folder, tiny_model_dir, rows=ROWS, query=QUERY, judge={"batch_tokens": 64})
    assert run_cli(["pipeline", str(file), "-o", str(folder / "out"), "-q"]) == 0
    return final(folder / "out")


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "kind"), [("answers", "generate"), ("judge", "score"), ("kept", "sql")])
def test_kill_9_mid_stage_then_the_same_command_finishes_each_row_once(tiny_model_dir, tmp_path, reference,
                                                                        stage, kind):
    file = write_pipeline(tmp_path, tiny_model_dir, rows=ROWS, query=SLOW if kind == "sql" else QUERY,
                          judge={"batch_tokens": 64})
    out = tmp_path / "out"
    process, lines = start(file, out)
    deadline = time.monotonic() + 300
    while not midway(out, stage, kind, lines):
        assert process.poll() is None, f"the pipeline ended before {stage} was caught mid-way: {lines[-5:]}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if kind == "sql":  # inside the query: the process has burnt CPU since the stage said it was running
        started = cpu_seconds(process.pid)
        while cpu_seconds(process.pid) - started < 0.3:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
    process.kill()
    process.wait()
    if kind != "sql":
        assert '"status": "complete"' not in (out / stage / MANIFEST_FILE).read_text() \
            if (out / stage / MANIFEST_FILE).exists() else True
    else:
        assert not (out / "kept" / "part-00000.parquet").exists()  # no half of a result
    report = cbgen.pipeline(file, out, progress=False)
    assert report.exit_code == 0
    states = {outcome.name: outcome for outcome in report.stages}
    order = [s.name for s in cbgen_stages(file)]
    assert all(states[name].state == "up to date" for name in order[: order.index(stage)])  # not run again
    killed = states[stage]
    assert killed.state == "ran", killed
    if kind != "sql":  # it resumed: what it had committed was kept, the rest generated
        assert killed.summary is not None and killed.summary.resumed_requests > 0
    for name, expected in (("questions", ROWS), ("answers", 2 * ROWS), ("judge", 2 * ROWS)):
        counts = ids(out / name)
        assert len(counts) == expected and set(counts.values()) == {1}, name  # every row, each once
    assert final(out) == reference  # as an uninterrupted run makes it
    assert run_cli(["status", str(out)]) == 0


def cbgen_stages(file: Path):
    from cbgen.pipelines import load_pipeline

    return load_pipeline(file).stages
