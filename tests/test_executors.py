"""--executor ray's checks, which need no cluster: what it refuses up front, and a task that cannot see the output
directory (storage that is not shared between nodes)."""

from __future__ import annotations

import pytest

from cbgen.cli import run_cli
from cbgen.config import JobConfig
from cbgen.errors import CbgenError
from cbgen.executors.ray import run_shard
from tests.helpers import write_jsonl


@pytest.mark.parametrize(("flags", "message"), [
    ([], "--executor ray needs --num-shards N"),
    (["--num-shards", "2", "--shard-index", "0"], "--executor ray runs every shard itself: drop --shard-index"),
])
def test_refused_before_anything_starts(tmp_path, capsys, flags, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    assert run_cli(["run", str(path), "-o", str(tmp_path / "out"), "--executor", "ray", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_task_that_cannot_see_the_output_directory_says_so(tmp_path):
    with pytest.raises(CbgenError, match="is not visible from node .*: with --executor ray it must be on storage "
                                         "every node sees"):
        run_shard(JobConfig(), str(tmp_path / "elsewhere" / ".cbgen-ray-0"))
