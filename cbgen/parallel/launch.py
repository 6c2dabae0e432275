"""Where a job runs, decided once from its settings for the entry that starts it: here in one process (local), over
--data-parallel replica processes on this node, over the ranks of a torchrun group (--tp), or as Ray tasks, a shard
each (--executor ray). Every entry asks `launch_of` before anything runs (cbgen run, score and embed, the Python API,
a pipeline's stages), so a setting an entry cannot honour is refused in one line instead of being ignored."""

from __future__ import annotations

from cbgen.config import JobConfig
from cbgen.errors import CbgenError

LOCAL, DATA_PARALLEL, TENSOR_PARALLEL, RAY = "local", "data-parallel", "tensor-parallel", "ray"
RAY_ENTRY = "cbgen run"  # the one entry that hands its shards to Ray (cbgen.executors.ray)


def launch_of(job: JobConfig, entry: str) -> str:
    """How `job` runs (LOCAL, DATA_PARALLEL, TENSOR_PARALLEL or RAY), for `entry` ("cbgen run", "cbgen score",
    "cbgen embed", "the Python API", "pipeline stage NAME"). Raises CbgenError for what that entry cannot run."""
    if job.run.executor == "ray":
        if entry != RAY_ENTRY:
            raise CbgenError(f"--executor ray (run.executor) runs `cbgen run` jobs only, and this is {entry}: drop "
                             "it, or split the input with --num-shards and run the parts yourself")
        return RAY
    if job.model.tp_size > 1 and job.run.data_parallel > 1:
        raise CbgenError("--data-parallel with --tp is not supported yet: use one of them")
    if job.model.tp_size > 1:
        return TENSOR_PARALLEL
    return DATA_PARALLEL if job.run.data_parallel > 1 else LOCAL
