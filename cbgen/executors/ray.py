"""`cbgen run --executor ray --num-shards N`: each shard of the job is one Ray task, on whichever node has the
resources it asks for (`--ray-num-cpus`, `--ray-num-gpus`). A task is cbgen's own shard job (`--shard-index I`), run
in the task's worker process: resume, the directory lock and exactly-once hold per shard as they do under Slurm.

Ray re-runs a task whose worker or node was lost (and one whose job stopped on SIGTERM, exit 75); the retry
resumes the shard's directory where its committed shards end. The driver (this process) connects to the cluster in
RAY_ADDRESS, or starts a local one; shows the shards' combined progress from the output directory; and, once all
tasks are done, merges the shards (`cbgen merge`: every input id exactly once) into DIR/merged.

The output directory (and the input file) must be on storage every node sees: the driver leaves a marker file in
the directory, and a task that cannot see it fails at once, saying so.
"""

from __future__ import annotations

import copy
import os
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cbgen.config import JobConfig
from cbgen.errors import CbgenError, ExitCode

RETRIES = 3  # re-runs of a shard whose worker or node was lost, or whose job was stopped
POLL_SECONDS = 5.0


class ShardStopped(Exception):
    """A shard's job stopped before its end (SIGTERM, --max-errors): Ray retries it, and the retry resumes."""


def run_shard(job: JobConfig, marker: str) -> dict[str, Any]:
    """The Ray task: one shard's job, in this worker process."""
    if not Path(marker).exists():
        raise CbgenError(f"the output directory '{Path(marker).parent}' is not visible from node "
                         f"{socket.gethostname()}: with --executor ray it must be on storage every node sees "
                         "(a shared file system)")
    from cbgen.job.run import run_job
    from cbgen.progress import NullProgress

    summary = run_job(job, NullProgress(), threading.Event(), None)
    code = int(summary.exit_code)
    if code not in (ExitCode.OK, ExitCode.SOME_FAILED):
        raise ShardStopped(f"shard {job.run.shard_index} stopped with exit code {code} ({summary.status})")
    return {"shard": job.run.shard_index, "exit_code": code, "node": socket.gethostname(),
            "succeeded": summary.succeeded, "failed": summary.failed, "resumed": summary.resumed_requests}


def shard_job(job: JobConfig, index: int, output_dir: Path, input_path: str) -> JobConfig:
    shard = copy.deepcopy(job)
    shard.run.executor, shard.run.shard_index = "local", index
    shard.output.dir, shard.input.path = str(output_dir), input_path
    shard.run.quiet = True
    return shard


def run_on_ray(job: JobConfig, say: Callable[[str], None]) -> int:
    """Runs every shard as a Ray task and merges them; returns the exit code (`say`: one line to the user)."""
    count, given_input = _checked(job)
    try:
        import ray
    except ImportError:
        raise CbgenError("--executor ray needs Ray: pip install 'cbgen[ray]'") from None
    base = Path(job.output.dir).expanduser().resolve()
    base.mkdir(parents=True, exist_ok=True)
    local_input = Path(given_input).expanduser()
    input_path = str(local_input.resolve()) if local_input.exists() else given_input
    marker = base / f".cbgen-ray-{uuid.uuid4().hex}"
    marker.write_text("cbgen --executor ray: tasks check that they see this directory\n")
    try:
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        say(f"Ray cluster: {'RAY_ADDRESS ' + address if address else 'a local one'}, "
            f"{ray.cluster_resources().get('CPU', 0):.0f} CPUs, {ray.cluster_resources().get('GPU', 0):.0f} GPUs; "
            f"{count} shards")
        # max_calls=1: a worker process serves one shard and exits, giving its memory (the model) back
        task = ray.remote(  # type: ignore[call-overload]  # Ray's types say retry_exceptions is a bool; a list is
            num_cpus=job.run.ray_num_cpus if job.run.ray_num_cpus is not None else 1,  # documented and works
            num_gpus=job.run.ray_num_gpus or 0, max_calls=1, max_retries=RETRIES,
            retry_exceptions=[ShardStopped])(run_shard)
        pending = {task.remote(shard_job(job, i, base, input_path), str(marker)): i for i in range(count)}
        failures = _wait(ray, pending, base, input_path, say)
    finally:
        marker.unlink(missing_ok=True)
    return _merge(base, input_path, failures, say)


def _checked(job: JobConfig) -> tuple[int, str]:
    """The number of shards and the input file, once the job is known to be one Ray can run."""
    count, path = job.run.num_shards, job.input.path
    if count is None:
        raise CbgenError("--executor ray needs --num-shards N: each shard is one Ray task")
    if job.run.shard_index is not None:
        raise CbgenError("--executor ray runs every shard itself: drop --shard-index")
    if path is None or path == "-":
        raise CbgenError("--executor ray needs an input file the tasks can read, not standard input")
    if job.model.tp_size > 1:
        raise CbgenError("--executor ray does not start tensor-parallel shards; use --tp 1 (or one GPU per task)")
    return count, path


def _wait(ray: Any, pending: dict[Any, int], base: Path, input_path: str, say: Callable[[str], None]
          ) -> dict[int, str]:
    """Waits for the tasks, telling the combined progress; returns the shards that failed, with why."""
    from cbgen.outputs.collect import job_status

    failures: dict[int, str] = {}
    last = ""
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
        for ref in ready:
            index = pending.pop(ref)
            try:
                result = ray.get(ref)
                resumed = f" (resumed after {result['resumed']} requests)" if result["resumed"] else ""
                say(f"shard {index} done on {result['node']}{resumed}: {result['succeeded']} succeeded, "
                    f"{result['failed']} failed")
            except Exception as e:  # noqa: BLE001 - a task's error (after its retries) is that shard's failure
                cause = getattr(e, "cause", None) or e
                failures[index] = (str(cause).strip().splitlines() or [type(cause).__name__])[-1][:300]
                say(f"shard {index} failed: {failures[index]}")
        try:
            statuses = job_status(base, input_path)
        except CbgenError:
            continue  # no shard directory yet
        done = sum(s.done for s in statuses)
        expected = sum(s.expected or 0 for s in statuses)
        line = f"progress: {done}/{expected or '?'} requests in {len(statuses)} shards"
        if line != last:
            say(line)
            last = line
    return failures


def _merge(base: Path, input_path: str, failures: dict[int, str], say: Callable[[str], None]) -> int:
    from cbgen.outputs.collect import merge_shards

    if failures:
        say(f"{len(failures)} shard(s) failed: {', '.join(map(str, sorted(failures)))}; rerun the same command to "
            "resume them")
        return int(ExitCode.SOME_FAILED)
    report = merge_shards(base, None, input_path)
    if not report.complete:
        missing = sum(len(ids) for ids in report.missing.values())
        say(f"merge check failed: {missing} ids missing, {len(report.duplicated)} repeated; nothing merged")
        return int(ExitCode.SOME_FAILED)
    say(f"merged {report.rows} rows into {report.output}")
    return int(ExitCode.OK)
