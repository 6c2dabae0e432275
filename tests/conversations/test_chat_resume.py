"""kill -9 in the middle of a chat stage's turns, then the same command: every conversation once, each the same as an
uninterrupted run makes it (seeded sampling, a simulated user), and no turn the killed run finished is computed
again (its turns journal, cbgen.conversations.journal, carries them over)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest

import cbgen
from cbgen.rows import read_shards
from cbgen.rows.rundir import TURNS_FILE
from tests.conversations.test_chat import USER_TEMPLATE, chat_stage

ROWS = [{"id": f"t{i}", "topic": f"topic {i}"} for i in range(24)]
KEYS = {"user_template": USER_TEMPLATE, "max_turns": 3, "max_new_tokens": 16, "temperature": 0.9, "seed": 5,
        "rows_per_shard": 2, "commit_interval": 0.05}


@pytest.mark.slow
def test_kill_9_mid_turn_then_resume_keeps_every_finished_turn(tiny_model_dir, tmp_path):
    (tmp_path / "whole").mkdir()
    reference_file = chat_stage(tmp_path / "whole", tiny_model_dir, ROWS, **KEYS)
    assert cbgen.pipeline(reference_file, tmp_path / "whole" / "out", progress=False).exit_code == 0
    reference = {row["id"]: row["messages"] for row in read_shards(tmp_path / "whole" / "out" / "talks")}

    file = chat_stage(tmp_path, tiny_model_dir, ROWS, **KEYS)
    out = tmp_path / "out"
    journal = out / "talks" / TURNS_FILE
    process = subprocess.Popen([sys.executable, "-m", "cbgen", "pipeline", str(file), "-o", str(out), "-q"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (journal.exists() and journal.read_text().count("\n") >= 30 and list((out / "talks").glob("part-*"))):
        assert process.poll() is None, f"the stage ended before it was caught mid-way: {process.stderr.read()!r}"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.kill()
    process.wait()
    written = {row["id"]: len(row["turns"]) for row in read_shards(out / "talks")}
    journaled = Counter(json.loads(line)["id"] for line in journal.read_text().splitlines() if line.endswith("}"))
    carried = sum(n for key, n in journaled.items() if key not in written)
    assert written and carried, "the kill came before or after the turns it is meant to interrupt"

    report = cbgen.pipeline(file, out, progress=False)
    assert report.exit_code == 0
    rows = list(read_shards(out / "talks"))
    assert Counter(row["id"] for row in rows) == Counter(row["id"] for row in ROWS)  # each conversation once
    assert {row["id"]: row["messages"] for row in rows} == reference  # as the uninterrupted run made them
    summary = report.stages[0].summary
    total = sum(len(row["turns"]) for row in rows)
    assert summary.resumed_requests == len(written)
    assert summary.run_sequences == total - sum(written.values()) - carried  # no finished turn computed again
    assert not journal.exists()  # a complete run needs it no more
