"""Splitting one job's input across several jobs (Slurm array tasks, Kubernetes Indexed Jobs, or
--num-shards/--shard-index by hand).

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


COUNT_VARIABLE = "CBGEN_NUM_SHARDS"  # the number of shards, for schedulers that give only the index
K8S_INDEX = "JOB_COMPLETION_INDEX"  # set in each pod of a Kubernetes Indexed Job: 0 .. completions-1


def resolve_sharding(job: JobConfig, env: Mapping[str, str] = os.environ) -> Sharding | None:
    """(shard index, number of shards), or None for an unsplit job. Each comes from its flag, else its variable:
    the count from --num-shards or CBGEN_NUM_SHARDS, the index from --shard-index or JOB_COMPLETION_INDEX (a
    Kubernetes Indexed Job); with neither flag nor variable, both come from a Slurm array.

    Slurm numbers array tasks from SLURM_ARRAY_TASK_MIN in steps of SLURM_ARRAY_TASK_STEP (`--array=1-8` or
    `--array=0-14:2`), so the index is (TASK_ID - TASK_MIN) / TASK_STEP.
    """
    count = job.run.num_shards if job.run.num_shards is not None else _integer(env, COUNT_VARIABLE)
    index = job.run.shard_index if job.run.shard_index is not None else _integer(env, K8S_INDEX)
    if count is None and index is None:
        return _slurm(env)
    if count is None:
        source = "--shard-index" if job.run.shard_index is not None else f"{K8S_INDEX} (a Kubernetes Indexed Job)"
        raise CbgenError(f"{source} gives this job's shard but not how many there are: pass --num-shards N or set "
                         f"{COUNT_VARIABLE}=N (the Indexed Job's completions)")
    if index is None:
        raise CbgenError(f"--num-shards {count} needs this job's shard: pass --shard-index I (from 0), or run it as a "
                         f"Kubernetes Indexed Job ({K8S_INDEX}) or a Slurm array")
    if count < 1:
        raise CbgenError(f"the number of shards must be at least 1, got {count}")
    if not 0 <= index < count:
        raise CbgenError(f"shard index {index} must be below the number of shards {count} (counted from 0)")
    return (index, count) if count > 1 else None


def _integer(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise CbgenError(f"the variable {name} must be an integer, got {value!r}") from None


def _slurm(env: Mapping[str, str]) -> Sharding | None:
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
