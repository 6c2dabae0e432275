"""Where finished answers are kept: one small file per entry, named by its key, written under a temporary name and
renamed into place.

Why files and not SQLite: the writers cbgen must serve are the tasks of a Slurm array and the replicas of a
`--data-parallel` job on one node, and the tasks of arrays on several nodes over a shared filesystem. A rename within
one directory is atomic on local filesystems and on NFS, needs no lock and no server, and a `kill -9` at any moment
leaves either the old entry, the new one, or a stray temporary file that no reader ever opens; SQLite's WAL mode
relies on shared memory and byte-range locks that NFS does not honour. Each entry carries the SHA-256 of its payload:
one that is truncated, corrupt or from another version reads as a miss, never as an answer.

Entries are used least-recently first out: reading one touches its file, and `prune` deletes the oldest until the
cache is within its size.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbgen.files import read_json_or_none, write_text_atomic

FORMAT = 1
STALE_TEMP_SECONDS = 3600  # a temporary file this old belongs to a writer that was killed


@dataclass(frozen=True)
class CacheInfo:
    """What `cbgen cache info` reports."""

    directory: str
    entries: int
    bytes: int
    oldest_use: float | None  # seconds since the epoch
    newest_use: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"directory": self.directory, "entries": self.entries, "bytes": self.bytes,
                "oldest_use": self.oldest_use, "newest_use": self.newest_use}


def _digest(payload: str) -> str:
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class ResultStore:
    """Entries under `root/v1/<key[:2]>/<key>.json`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser()
        self.base = self.root / f"v{FORMAT}"

    def _path(self, key: str) -> Path:
        return self.base / key[:2] / f"{key}.json"

    def get(self, key: str, touch: bool = True) -> dict[str, Any] | None:
        """The entry's payload, or None when there is none (or it is unreadable, torn or corrupt). A hit counts as a
        use for the eviction order, unless `touch` is False."""
        path = self._path(key)
        stored = read_json_or_none(path)
        if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("payload"), str):
            return None
        if _digest(stored["payload"]) != stored.get("sha256"):
            return None
        try:
            payload = json.loads(stored["payload"])
        except ValueError:
            return None
        if touch:
            try:
                os.utime(path)  # a use: least recently used entries go first
            except OSError:
                pass  # a read-only cache still serves its hits
        return payload if isinstance(payload, dict) else None

    def put(self, key: str, payload: dict[str, Any]) -> bool:
        """Writes an entry; False when the cache cannot be written (a job never fails for its cache)."""
        path = self._path(key)
        text = json.dumps(payload, separators=(",", ":"), sort_keys=True)
        record = json.dumps({"format": FORMAT, "key": key, "sha256": _digest(text), "payload": text})
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, record)  # under a hidden temporary name, renamed into place
        except OSError:
            return False
        return True

    def _files(self) -> Iterator[os.DirEntry]:
        try:
            folders = list(os.scandir(self.base))
        except OSError:
            return
        for folder in folders:
            if not folder.is_dir():
                continue
            try:
                yield from (entry for entry in os.scandir(folder.path) if entry.is_file())
            except OSError:
                continue

    def info(self) -> CacheInfo:
        entries, size, oldest, newest = 0, 0, None, None
        for entry in self._files():
            if entry.name.startswith("."):
                continue
            try:
                stat = entry.stat()
            except OSError:
                continue
            entries += 1
            size += stat.st_size
            oldest = stat.st_mtime if oldest is None else min(oldest, stat.st_mtime)
            newest = stat.st_mtime if newest is None else max(newest, stat.st_mtime)
        return CacheInfo(str(self.root.resolve()), entries, size, oldest, newest)

    def prune(self, max_bytes: int) -> tuple[int, int]:
        """Deletes the least recently used entries until the cache holds at most `max_bytes` (and temporary files
        left by killed writers); returns (entries deleted, bytes freed)."""
        now = time.time()
        files: list[tuple[float, int, str]] = []
        for entry in self._files():
            try:
                stat = entry.stat()
            except OSError:
                continue
            if entry.name.startswith("."):
                if now - stat.st_mtime > STALE_TEMP_SECONDS:
                    _remove(entry.path)
                continue
            files.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        deleted = freed = 0
        for _, size, path in sorted(files):
            if total <= max_bytes:
                break
            if _remove(path):
                total -= size
                deleted += 1
                freed += size
        return deleted, freed

    def clear(self) -> tuple[int, int]:
        """Deletes every entry; returns (entries deleted, bytes freed)."""
        return self.prune(0)


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True
