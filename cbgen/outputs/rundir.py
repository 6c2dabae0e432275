"""The output directory of a run: one writer at a time (a lock), what the run is (a fingerprint), and what it has
already done (the committed shards), so that running the same command again resumes it exactly once.

Everything a resume trusts is on disk under a final name only once complete: shards are renamed into place whole
(see writers.py), and the fingerprint file likewise. A killed run leaves at most hidden temporary files, removed here.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cbgen.errors import CbgenError
from cbgen.outputs.writers import read_shards, shard_paths

LOCK_FILE = ".cbgen.lock"
FINGERPRINT_FILE = "fingerprint.json"
MANIFEST_FILE = "run.json"
_SAMPLE = 1 << 20  # bytes hashed at each end of an input file to recognise it


class DirectoryLock:
    """An exclusive lock on an output directory, held for the life of the process.

    It is a kernel lock (flock) on a file in the directory: the kernel drops it when the process ends however it
    ends, so a run killed with SIGKILL never leaves a stale lock behind. The file names the holder for the message a
    second run gets.
    """

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> DirectoryLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise CbgenError(
                f"output directory '{self.path.parent}' is in use by {holder}; wait for that run to end, "
                "or choose another directory with -o"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"cbgen pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None

    def __enter__(self) -> DirectoryLock:
        return self if self._file is not None else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def input_identity(path: str) -> dict[str, Any]:
    """What makes an input the same input: its size and the hash of its first and last MiB (not its path, so a
    moved file still resumes; not its mtime, which copies and checkouts change). Stdin has no identity."""
    if path == "-":
        return {"source": "stdin"}
    target = Path(path)
    if not target.exists():
        return {"hub_dataset": path}  # a hub id: its revision is the hub's business
    # a folder: its data files (Parquet files, a dataset saved with save_to_disk, a dataset repository's files)
    files = sorted(p for p in target.rglob("*") if p.is_file() and not p.name.startswith(".")) \
        if target.is_dir() else [target]
    digest = hashlib.sha256()
    size = 0
    for file in files:
        file_size = file.stat().st_size
        size += file_size
        with open(file, "rb") as f:
            digest.update(f.read(_SAMPLE))
            if file_size > _SAMPLE:
                f.seek(max(_SAMPLE, file_size - _SAMPLE))
                digest.update(f.read(_SAMPLE))
    return {"files": len(files), "bytes": size, "sha256_head_tail": digest.hexdigest()}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def compare_fingerprints(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The differences between two fingerprints, as 'key: old -> new' (empty when they match)."""
    old, new = _flatten(stored), _flatten(json.loads(json.dumps(current, default=str)))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)]


@dataclass
class DoneIndex:
    """What the committed shards of a directory already hold."""

    ids: set[str] = field(default_factory=set)
    requests: int = 0
    failed_requests: int = 0
    sequences: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    next_shard: int = 0

    @property
    def succeeded(self) -> int:
        return self.sequences - self.failed


def scan_done(directory: Path) -> DoneIndex:
    """Reads the ids and counts of every committed shard. A request's sequences are always committed together, so
    an id present once is done."""
    index = DoneIndex()
    shards = shard_paths(directory)
    if shards:
        index.next_shard = shards[-1][0] + 1
    columns = ["id", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "sample_index"]
    failed_ids: set[str] = set()
    for row in read_shards(directory, columns=columns):
        index.sequences += 1
        index.generated_tokens += row["num_generated_tokens"]
        if row["finish_reason"] == "error":
            index.failed += 1
            failed_ids.add(row["id"])
        if row["id"] not in index.ids:
            index.ids.add(row["id"])
            index.requests += 1
            index.prompt_tokens += row["num_prompt_tokens"]
    index.failed_requests = len(failed_ids)
    return index


def remove_temporary_files(directory: Path) -> None:
    """Drops what a killed run was still writing: hidden `.part-*.tmp` shards and `.*.tmp` manifests."""
    for path in Path(directory).glob(".*.tmp"):
        path.unlink(missing_ok=True)


def clear_results(directory: Path) -> None:
    """--overwrite: removes the shards, fingerprint and manifest of an earlier run (the lock stays ours)."""
    for _, path in shard_paths(directory):
        path.unlink()
    for name in (FINGERPRINT_FILE, MANIFEST_FILE):
        (Path(directory) / name).unlink(missing_ok=True)
    remove_temporary_files(directory)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CbgenError(f"'{path}' cannot be read ({e}); remove it, or pass --overwrite to start over") from None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Writes `data` as JSON under a temporary name, then renames it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_run_directory(
    directory: Path, fingerprint: dict[str, Any], job: dict[str, Any], overwrite: bool
) -> tuple[DirectoryLock, DoneIndex]:
    """Locks `directory` and returns what it already holds, after checking it belongs to the same job.

    FINGERPRINT_FILE keeps the fingerprint (compared on every resume) and the job's configuration (for `cbgen
    status` and `cbgen merge`). A directory with results of a different job is refused unless `overwrite`; so is
    one with shards but no fingerprint (not written by cbgen, or by a version without fingerprints).
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CbgenError(f"output directory '{directory}' is a file; choose another with -o")
    try:
        lock = DirectoryLock(directory).acquire()
    except OSError as e:
        reason = e.strerror or e
        raise CbgenError(f"output directory '{directory}' is not writable: {reason}; choose another with -o") from None
    try:
        remove_temporary_files(directory)
        if overwrite:
            clear_results(directory)
        stored = read_json(directory / FINGERPRINT_FILE)
        if stored is None:
            if shard_paths(directory):
                raise CbgenError(
                    f"output directory '{directory}' holds shards but no {FINGERPRINT_FILE}, so cbgen cannot tell "
                    "which job wrote them; choose another directory with -o, or pass --overwrite to replace them"
                )
            write_json_atomic(directory / FINGERPRINT_FILE, {"fingerprint": fingerprint, "job": job})
            return lock, DoneIndex()
        differences = compare_fingerprints(stored.get("fingerprint", {}), fingerprint)
        if differences:
            raise CbgenError(
                f"output directory '{directory}' holds a run of a different job ({'; '.join(differences)}); "
                "rerun with the same model, input and generation settings to resume it, pass --overwrite to start "
                "over, or choose another directory with -o"
            )
        return lock, scan_done(directory)
    except BaseException:
        lock.release()
        raise
