"""Small JSON files written atomically: under a hidden temporary name, then renamed into place, so a reader never
sees half of one (a kill or a full disk leaves at most a `.NAME.*.tmp` file behind)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard


def write_json_atomic(path: Path, data: Any, *, durable: bool = True) -> None:
    """Writes `data` as JSON at `path`. The temporary name is unique, so concurrent writers never share one;
    `durable` also flushes it to disk before the rename."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2, default=str) + "\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def read_json_or_none(path: Path) -> Any:
    """The JSON in `path`, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def fsync_directory(directory: Path) -> None:
    """Make the rename itself durable, not only the shard's bytes."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Writes `text` (UTF-8) at `path` under a temporary name first, then renames it into place."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        temp.write_text(text, encoding="utf-8")
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def file_digest(path: Path, memo: Path | None = None) -> str:
    """SHA-256 of a file, memoised in the JSON file `memo` by (real path, size, mtime), so a large GGUF is read in
    full once (about 1.5 GB/s) and not on every run."""

    def sha256() -> str:
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
        return sha.hexdigest()

    return file_fact(path, memo, "sha256", sha256, str)


def file_fact(path: Path, memo: Path | None, name: str, compute: Callable[[], Any], kind: type) -> Any:
    """`compute()`, a fact about the file at `path` (its digest, its GGUF weight type), memoised under `name` in the
    JSON file `memo` by (real path, size, mtime): a file changed in place is read again."""
    stat = path.stat()
    real = str(path.resolve())
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    known = (read_json_or_none(memo) if memo else None) or {}
    entry = known.get(real) if isinstance(known, dict) else None
    if _stamped(entry, stamp) and isinstance(entry.get(name), kind):
        return entry[name]
    value = compute()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            fresh = read_json_or_none(memo)
            known = fresh if isinstance(fresh, dict) else {}
            old = known.get(real)  # the file's other facts, kept while they are of this same file
            known[real] = {**(old if _stamped(old, stamp) else {}), **stamp, name: value}
            write_json_atomic(memo, known, durable=False)
        except OSError:
            pass  # a read-only cache still serves hits; the fact is worked out again next time
    return value


def _stamped(entry: Any, stamp: dict[str, int]) -> TypeGuard[dict[str, Any]]:
    """Whether a memo's entry was written for the file as `stamp` (its size and mtime) says it is now."""
    return isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp
