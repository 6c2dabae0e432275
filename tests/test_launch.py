"""Where a job runs is decided once (cbgen.parallel.launch), and every entry asks: --executor ray is honoured by
`cbgen run` and refused in one line by the entries that cannot hand work to Ray (they ignored it before)."""

from __future__ import annotations

import pytest

import cbgen
from cbgen.cli import run_cli
from cbgen.config import JobConfig
from cbgen.errors import CbgenError
from cbgen.parallel.launch import DATA_PARALLEL, LOCAL, RAY, TENSOR_PARALLEL, launch_of
from tests.helpers import write_jsonl


def test_one_decision_for_every_entry():
    job = JobConfig()
    assert launch_of(job, "cbgen score") == LOCAL
    job.run.data_parallel = 2
    assert launch_of(job, "the Python API") == DATA_PARALLEL
    job.model.tp_size = 2
    with pytest.raises(CbgenError, match="--data-parallel with --tp is not supported yet"):
        launch_of(job, "cbgen run")
    job.run.data_parallel = 1
    assert launch_of(job, "cbgen run") == TENSOR_PARALLEL
    job = JobConfig()
    job.run.executor = "ray"
    assert launch_of(job, "cbgen run") == RAY
    with pytest.raises(CbgenError, match=r"runs `cbgen run` jobs only, and this is cbgen embed: drop it"):
        launch_of(job, "cbgen embed")


@pytest.mark.parametrize("command", ["score", "embed"])
def test_commands_that_cannot_use_ray_refuse_it_in_one_line(command, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"text": "a", "prompt": "a", "completion": " b"}])
    config = tmp_path / "job.yaml"  # they take no --executor flag, and a job file's run.executor was ignored
    config.write_text("run:\n  executor: ray\n")
    assert run_cli([command, str(rows), "-o", str(tmp_path / "out"), "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"this is cbgen {command}" in err
    assert not (tmp_path / "out").exists()


def test_the_python_api_refuses_ray_before_loading():
    with pytest.raises(CbgenError, match="this is the Python API"):
        cbgen.Embedder("nonexistent-but-never-loaded", executor="ray")
    generator = cbgen.Generator(executor="ray")  # settings are checked when a call starts; nothing loads before
    with pytest.raises(CbgenError, match="this is the Python API"):
        generator.generate(["Hello"])
    assert generator._loaded is None
