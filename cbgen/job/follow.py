"""A tensor-parallel follower's job: rank 0 reads, plans and writes (cbgen.job.run); every other rank loads its
shard of the model and serves the manager rank 0's plan describes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cbgen.config import JobConfig
from cbgen.errors import ExitCode
from cbgen.process.startup import release_gc

if TYPE_CHECKING:
    from cbgen.engine.job_plan import JobPlan
    from cbgen.parallel.tensor import TensorParallel


def follow_job(job: JobConfig, tp: TensorParallel) -> int:
    """A tensor-parallel follower's whole job: load its shard of the model, then serve the manager of rank 0's plan
    until rank 0 stops it. Returns the exit code; raises cbgen.parallel.tensor.RankZeroStopped, with rank 0's message,
    when rank 0 failed before sending its plan."""
    from cbgen.engine.manager import serve
    from cbgen.model.load import load_model
    from cbgen.parallel.tensor import LOAD, PLAN, RankZeroStopped

    try:
        tp.receive(LOAD)
        loaded = load_model(job.model, tp)
        release_gc()
        plan: JobPlan = tp.receive(PLAN)
    except RankZeroStopped as stopped:
        if stopped.exit_code == ExitCode.OK:
            return ExitCode.OK
        raise
    serve(loaded.model, loaded.tokenizer, plan.engine.settings.spec)
    return ExitCode.OK
