"""Tensor parallelism: one job over the N processes `torchrun --nproc-per-node N -m cbgen run ... --tp N` starts.

Transformers shards the model (`DistributedConfig(tp_size=N)`), and its continuous batching manager keeps the ranks
in step by itself: rank 0 is the driver, whose new requests and cancellations it broadcasts to the other ranks every
step; every rank schedules the same batches, runs its shard, and takes part in the collectives. So in cbgen only rank
0 reads the input, writes the output and shows progress. The other ranks (followers) load the model, build a manager
from exactly the configuration rank 0 sends them (a KV cache sized from one rank's free memory on another would
schedule differently and desynchronise the collectives), and run it until rank 0 stops it.

cbgen's own messages go over a separate gloo group: the default group belongs to the manager's collectives, and a
broadcast of ours on it while the manager runs would interleave with them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from cbgen.config import JobConfig
from cbgen.errors import CbgenError

LOAD = "load"


@dataclass
class TensorParallel:
    size: int
    rank: int
    group: Any  # cbgen's own gloo group
    _pending: list[str] = field(default_factory=lambda: ["load", "spec"])  # messages rank 0 still owes

    @property
    def driver(self) -> bool:
        return self.rank == 0

    def share(self, value: Any = None) -> Any:
        """Rank 0's `value`, on every rank (a collective: every rank must call it, in the same order)."""
        import torch.distributed as dist

        box = [value if self.driver else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if self._pending:
            self._pending.pop(0)
        return box[0]

    def release(self) -> None:
        """Rank 0 is done (or failed) before sending all its messages: tell the followers to stop waiting."""
        while self.driver and self._pending:
            self.share(None)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


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
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if on_gpu else "gloo")
    group = dist.new_group(backend="gloo")
    return TensorParallel(tp, dist.get_rank(), group)


def follow(job: JobConfig, tp: TensorParallel) -> None:
    """A follower's whole job: load the model shard, serve the manager rank 0 describes until rank 0 stops it."""
    from cbgen.engine.manager import serve
    from cbgen.model.load import load_model
    from cbgen.startup import release_gc

    if tp.share() != LOAD:
        return
    loaded = load_model(job.model, tp)
    release_gc()
    spec = tp.share()  # rank 0's ManagerSpec, or None when it stopped before starting an engine
    if spec is not None:
        serve(loaded.model, loaded.tokenizer, spec)
