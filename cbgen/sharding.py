"""Splitting one job's input across several jobs (Slurm array tasks, or --num-shards/--shard-index by hand).

A request belongs to shard `hash(id) % N`, a stable hash that is the same on every machine and Python run, and shard
I of N writes to `DIR/shard-0000I-of-0000N/`. `cbgen merge` puts the shards back together.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

from cbgen.config import JobConfig
from cbgen.errors import CbgenError

Sharding = tuple[int, int]  # (this shard's index, number of shards)

_SHARD_DIRECTORY = re.compile(r"^shard-(\d{5})-of-(\d{5})$")


def resolve_sharding(job: JobConfig, env: Mapping[str, str] = os.environ) -> Sharding | None:
    """(shard index, number of shards) from the flags, else from a Slurm array's variables, else None.

    Slurm numbers array tasks from SLURM_ARRAY_TASK_MIN in steps of SLURM_ARRAY_TASK_STEP (`--array=1-8` or
    `--array=0-14:2`), so the index is (TASK_ID - TASK_MIN) / TASK_STEP.
    """
    if job.run.num_shards is not None:
        return (job.run.shard_index, job.run.num_shards) if job.run.num_shards > 1 else None
    if "SLURM_ARRAY_TASK_COUNT" not in env or "SLURM_ARRAY_TASK_ID" not in env:
        return None
    try:
        count = int(env["SLURM_ARRAY_TASK_COUNT"])
        task, first = int(env["SLURM_ARRAY_TASK_ID"]), int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        step = int(env.get("SLURM_ARRAY_TASK_STEP", "1") or 1)
    except ValueError:
        raise CbgenError(
            "the SLURM_ARRAY_TASK_* variables are not integers; pass --num-shards and --shard-index"
        ) from None
    index = (task - first) // step
    if not 0 <= index < count:
        raise CbgenError(f"Slurm array task {task} is outside its array (min {first}, step {step}, count {count}); "
                         "pass --num-shards and --shard-index")
    return (index, count) if count > 1 else None


def shard_of(request_id: str, num_shards: int) -> int:
    """The shard a request belongs to: a stable hash of its id (the same on every machine and Python run)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest(), "big") % num_shards


def shard_directory(base: Path, sharding: Sharding | None) -> Path:
    """Where a shard's job writes: the base directory itself when the job is not split."""
    return Path(base) if sharding is None else Path(base) / f"shard-{sharding[0]:05d}-of-{sharding[1]:05d}"


def parse_shard_directory(path: Path) -> Sharding | None:
    """The sharding a directory's name says (`shard-00001-of-00004` -> (1, 4)), or None."""
    match = _SHARD_DIRECTORY.match(Path(path).name)
    return (int(match.group(1)), int(match.group(2))) if match else None
