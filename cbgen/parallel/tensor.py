"""Tensor parallelism: one job over the N processes `torchrun --nproc-per-node N -m cbgen run ... --tp N` starts.

Transformers shards the model (`DistributedConfig(tp_size=N)`), and its continuous batching manager keeps the ranks
in step by itself: rank 0 is the driver, whose new requests and cancellations it broadcasts to the other ranks every
step; every rank schedules the same batches, runs its shard, and takes part in the collectives. So in cbgen only rank
0 reads the input, writes the output and shows progress. The other ranks (followers) load the model, build a manager
from exactly the plan rank 0 sends them (a KV cache sized from one rank's free memory on another would schedule
differently and desynchronise the collectives), and run it until rank 0 stops it.

cbgen's own messages go over a separate gloo group: the default group belongs to the manager's collectives, and a
broadcast of ours on it while the manager runs would interleave with them. Each message has a name, in the order
both sides follow:

    load         rank 0 has checked its input: load the model
    gguf-cache   (a GGUF model with the converted cache) whether rank 0 converts it first
    gguf-ready   (when it did) the converted model is in the cache
    plan         the job's plan (cbgen.job.plan.JobPlan): build its manager and serve it

Whenever rank 0 stops before sending the plan, whether it failed or found nothing to do, it sends that instead, and
a follower waiting for any message gets it at once: it exits with rank 0's message, never waiting for gloo's timeout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cbgen.config import JobConfig
from cbgen.errors import CbgenError, ExitCode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

LOAD, GGUF_CACHE, GGUF_READY, PLAN = "load", "gguf-cache", "gguf-ready", "plan"
_FINAL = PLAN  # after it, the followers serve the manager and wait for no message of ours
_STOP, _FAILED = "stop", "failed"  # rank 0 ended early: nothing to do, or an error (its message and exit code)


class RankZeroStopped(CbgenError):
    """On a follower: rank 0 ended before sending the plan. `exit_code` is rank 0's (0 when it had nothing to do)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[assignment]


@dataclass
class TensorParallel:
    size: int
    rank: int
    group: ProcessGroup  # cbgen's own gloo group
    _ended: bool = field(default=False, repr=False)  # rank 0: the followers wait for no more messages

    @property
    def driver(self) -> bool:
        return self.rank == 0

    def _broadcast(self, message: tuple[str, Any]) -> tuple[str, Any]:
        import torch.distributed as dist

        box: list[Any] = [message if self.driver else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send(self, name: str, value: Any = None) -> None:
        """Rank 0: the message `name` to every follower (each waits for it in `receive(name)`)."""
        assert self.driver and not self._ended, f"rank 0 sends {name!r} after its last message"
        self._broadcast((name, value))
        self._ended = name == _FINAL

    def receive(self, name: str) -> Any:
        """A follower: the value of rank 0's message `name`. Raises RankZeroStopped when rank 0 ended instead."""
        got, value = self._broadcast(("", None))
        if got == name:
            return value
        if got == _STOP:
            raise RankZeroStopped(f"rank 0 stopped before {name!r}: {value}", ExitCode.OK)
        if got == _FAILED:
            message, code = value
            raise RankZeroStopped(f"rank 0 failed before {name!r}: {message}", code)
        raise CbgenError(f"tensor parallel: rank 0 sent {got!r} where this rank waited for {name!r}")

    def share(self, name: str, value: Any = None) -> Any:
        """Rank 0's `value` of message `name`, on every rank (rank 0 sends it, the followers receive it)."""
        if self.driver:
            self.send(name, value)
            return value
        return self.receive(name)

    def end(self, error: BaseException | None = None) -> None:
        """Rank 0 is done: followers still waiting for a message are told why (nothing to do, or `error`)."""
        if not self.driver or self._ended:
            return
        if error is None:
            self._broadcast((_STOP, "nothing to do"))
        else:
            code = int(getattr(error, "exit_code", ExitCode.INTERNAL))
            self._broadcast((_FAILED, (str(error) or type(error).__name__, code)))
        self._ended = True


    def close(self) -> None:
        """Leaves the process group (a group left alive aborts the process as Python exits)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def setup(job: JobConfig, env: dict[str, str] | None = None) -> TensorParallel | None:
    """Joins the process group torchrun set up, or None for a single-process job."""
    env = dict(os.environ) if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    tp = job.model.tp_size
    if tp == 1 and world == 1:
        return None
    if world != tp:
        if world == 1:
            raise CbgenError(f"--tp {tp} needs {tp} processes: start the job with `torchrun --nproc-per-node {tp} "
                             f"-m cbgen run ... --tp {tp}`")
        raise CbgenError(f"torchrun started {world} processes but --tp is {tp}: give --tp {world} (cbgen shards "
                         "the model over all of them)")
    import torch
    import torch.distributed as dist

    on_gpu = job.model.device == "cuda" or (job.model.device == "auto" and torch.cuda.is_available())
    if on_gpu:
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
        if job.batching.get("disable_nccl_graph_mixing", True):
            # NCCL reads it once, when the process group starts: transformers' own setting of it comes with the
            # continuous batching config, after this. Continuous batching never mixes graphs that communicate
            os.environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if on_gpu else "gloo")
    group = dist.new_group(backend="gloo")
    return TensorParallel(tp, dist.get_rank(), group)
