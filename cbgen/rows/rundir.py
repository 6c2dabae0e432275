"""The output directory of a run: one writer at a time (a lock), what the run is (a fingerprint), and what it has
already done (the committed shards), so that running the same command again resumes it exactly once.

Everything a resume trusts is on disk under a final name only once complete: shards are renamed into place whole
(see writers.py), and the fingerprint file likewise. A killed run leaves at most hidden temporary files, removed here.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cbgen.errors import CbgenError
from cbgen.files import write_json_atomic
from cbgen.rows.columns import OutputColumns
from cbgen.rows.shards import DoneIndex, done_index, read_shards, settle, shard_paths

LOCK_FILE = ".cbgen.lock"
FINGERPRINT_FILE = "fingerprint.json"
MANIFEST_FILE = "run.json"
TURNS_FILE = "turns.jsonl"  # a chat job's finished turns of conversations not yet written (cbgen.conversations)
# The format of fingerprint.json and run.json, raised whenever what they hold changes meaning (see StoredRun).
FORMAT = 3
# What each format added to the fingerprint: a run of an older format resumes without them (it recorded none).
ADDED_IN = {3: ("model.sha256", "model.weights", "model.commit", "input.sha256", "input.revision")}


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


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def compare_fingerprints(stored: dict[str, Any], current: dict[str, Any], stored_format: int = FORMAT) -> list[str]:
    """The differences between two fingerprints, as 'key: old -> new' (empty when they match). A setting that the
    stored fingerprint lacks (added to cbgen after that run) matches while it is off: None, False or empty; what a
    later format added (ADDED_IN) matches whatever it is, for a run of an earlier format."""
    old, new = _flatten(stored), _flatten(json.loads(json.dumps(current, default=str)))
    added = tuple(key for version, keys in ADDED_IN.items() if stored_format < version for key in keys)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key) and not (key not in old and new.get(key) in (None, False, [], {}))
            and not (key not in old and key.startswith(added))]


def read_json(path: Path) -> dict[str, Any] | None:
    """A run directory's JSON file, None when missing; a damaged one is a CbgenError that says what to do."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CbgenError(f"'{path}' cannot be read ({e}); remove it, or pass --overwrite to start over") from None


@dataclass
class StoredRun:
    """What fingerprint.json says of the job a directory holds.

    Format 1 (cbgen 0.1.0 up to the restructuring) had no `format` key and no record of the ids: it numbered rows
    unless --id-column named a field (OpenAI batch files: custom_id). Format 2 adds both; since format 2, rows that
    carry an `id` field are known by it without --id-column, so a format-1 directory resumes with that detection
    off and its ids stay what they were.
    """

    format: int
    fingerprint: dict[str, Any]
    job: dict[str, Any]
    ids: dict[str, Any] | None = None  # {"column": name or None, "chosen_by": ...}; None in format 1
    # the rows' columns, recorded once the run has planned (None before that, and in directories of older cbgens)
    columns: OutputColumns | None = None
    data: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the whole file, as read

    @property
    def detects_ids(self) -> bool:
        """Whether the run that wrote it took the rows' own `id` field without being told."""
        return self.format >= 2

    def to_dict(self) -> dict[str, Any]:
        out = {"format": self.format, "fingerprint": self.fingerprint, "job": self.job, "ids": self.ids}
        return out | ({"columns": self.columns.to_dict()} if self.columns is not None else {})


def read_stored_run(directory: Path) -> StoredRun | None:
    """The directory's fingerprint.json, any format, or None when it has none."""
    data = read_json(Path(directory) / FINGERPRINT_FILE)
    if data is None:
        return None
    version = data.get("format", 1)
    if not isinstance(version, int) or version > FORMAT:
        raise CbgenError(f"'{Path(directory) / FINGERPRINT_FILE}' was written by a newer cbgen (format {version}, this "
                         f"one reads up to {FORMAT}); upgrade cbgen, or choose another directory with -o")
    columns = OutputColumns.from_dict(data["columns"]) if isinstance(data.get("columns"), dict) else None
    return StoredRun(version, data.get("fingerprint", {}), data.get("job", {}), data.get("ids"), columns, data)


def redo_history(directory: Path) -> list[dict[str, Any]]:
    """The redos run in a directory, oldest first (for run.json)."""
    return list((read_json(Path(directory) / FINGERPRINT_FILE) or {}).get("redos") or [])


def stored_columns(directory: Path, stored: StoredRun) -> OutputColumns:
    """The columns of a directory's rows: as recorded, or read off its first shard when the run that wrote it
    predates their record."""
    if stored.columns is not None:
        return stored.columns
    kept = tuple(stored.job.get("input", {}).get("keep_columns") or ())
    for _, path in shard_paths(directory):
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return OutputColumns.from_names(set(pq.read_schema(path).names), kept)
        row = next(read_shards(directory, as_rows=False), None)
        return OutputColumns.from_names(set(row or ()), kept)
    return OutputColumns(kept=kept)


class RunDirectory:
    """A job's output directory over one run's life: what it held before the run (`stored`); once opened, its lock
    and what its committed shards already hold (`done`); the rows' columns recorded once the run has planned; a
    redo ended when every request is written; the lock let go when the run's `with` block ends.

    FINGERPRINT_FILE keeps the fingerprint (compared on every resume), the job's configuration and where its ids
    come from (for `cbgen status` and `cbgen merge`). A directory with results of a different job is refused unless
    `overwrite`; so is one with shards but no fingerprint (not written by cbgen). A directory written in an older
    format is brought to this one once it is known to hold the same job. With `redo` (--redo), the generation
    settings may differ from the stored ones, and the requests to redo are taken out of the shards first
    (cbgen.rows.redo).
    """

    def __init__(self, path: Path, *, overwrite: bool = False, same_input: bool = False) -> None:
        self.path = Path(path)
        self.overwrite = overwrite
        self.same_input = same_input  # the user says a stdin job's feed is the one its earlier run read
        self.stored = read_stored_run(self.path) if self.path.is_dir() and not overwrite else None
        self.done = DoneIndex()
        self._lock: DirectoryLock | None = None

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def open(self, fingerprint: dict[str, Any], job: dict[str, Any], ids: dict[str, Any], redo: Sequence[str] = ()
             ) -> RunDirectory:
        """Locks the directory and reads what it already holds (`done`), after checking it belongs to the same
        job (see the class's docstring); use as `with directory.open(...):`, which lets the lock go at its end."""
        directory = self.path
        if directory.exists() and not directory.is_dir():
            raise CbgenError(f"output directory '{directory}' is a file; choose another with -o")
        try:
            lock = DirectoryLock(directory).acquire()
        except OSError as e:
            reason = e.strerror or e
            raise CbgenError(f"output directory '{directory}' is not writable: {reason}; choose another with -o"
                             ) from None
        try:
            if self.overwrite:  # the earlier run's records go, and its shards with them (settle)
                for name in (FINGERPRINT_FILE, MANIFEST_FILE, TURNS_FILE):
                    (directory / name).unlink(missing_ok=True)
            stored = read_stored_run(directory)
            shards = settle(directory, clear=self.overwrite)
            self._check(stored, fingerprint, redo, bool(shards))
            current = StoredRun(FORMAT, fingerprint, job, ids)
            if stored is None:
                data: dict[str, Any] | None = current.to_dict()
            else:  # an older format brought to this one; a redo's requests taken out of the shards first
                data = current.to_dict() | {"upgraded_from": stored.format} if stored.format < FORMAT else None
                if redo:
                    from cbgen.rows.redo import start_redo

                    data = start_redo(shards, data or stored.data, fingerprint, redo)
                    shards = [(number, path) for number, path in shards if path.exists()]  # one left empty is gone
            done = DoneIndex() if stored is None else done_index(shards)
            if data is not None:
                write_json_atomic(directory / FINGERPRINT_FILE, data)
            self._lock, self.done = lock, done
            return self
        except BaseException:
            lock.release()
            raise

    def _check(self, stored: StoredRun | None, fingerprint: dict[str, Any], redo: Sequence[str], has_shards: bool
               ) -> None:
        """Refuses a directory that holds another job's results (or shards no cbgen run wrote)."""
        directory = self.path
        if stored is None:
            if redo:
                raise CbgenError(f"--redo generates part of an earlier run again, and '{directory}' holds none; run "
                                 "the job without --redo first")
            if has_shards:
                raise CbgenError(
                    f"output directory '{directory}' holds shards but no {FINGERPRINT_FILE}, so cbgen cannot "
                    "tell which job wrote them; choose another directory with -o, or pass --overwrite to replace "
                    "them"
                )
            return
        differences = compare_fingerprints(stored.fingerprint, fingerprint, stored.format)
        if redo:  # a redo runs with the job's current generation settings
            differences = [d for d in differences if not d.startswith("generation.")]
        if not differences and fingerprint.get("input") == {"source": "stdin"} and not self.same_input \
                and has_shards:
            raise CbgenError(
                f"output directory '{directory}' holds a run of a job that read stdin, and cbgen cannot tell whether "
                "this feed is the same one: pass --same-input if it is (its rows already written are skipped by "
                "id), --overwrite to start over, or choose another directory with -o")
        if differences:
            raise CbgenError(
                f"output directory '{directory}' holds a run of a different job ({'; '.join(differences)}); "
                "rerun with the same model, input and generation settings to resume it, pass --overwrite to "
                "start over, or choose another directory with -o"
            )

    def record_columns(self, columns: OutputColumns) -> None:
        """Keeps the columns a run's rows have beside its fingerprint, once it has planned. A directory whose rows
        were written with other columns is refused: its shards and the new ones could not be read as one table."""
        directory = self.path
        stored = read_stored_run(directory)
        if stored is None:
            raise CbgenError(f"'{directory / FINGERPRINT_FILE}' disappeared while the run was starting")
        if stored.columns == columns:
            return
        existing = stored_columns(directory, stored) if shard_paths(directory) else None
        if existing is not None and existing != columns:
            raise CbgenError(f"output directory '{directory}' holds rows with the columns "
                             f"{', '.join(existing.names)}; this run's rows would have {', '.join(columns.names)}; "
                             "pass --overwrite to start over, or choose another directory with -o")
        data = read_json(directory / FINGERPRINT_FILE) or {}
        write_json_atomic(directory / FINGERPRINT_FILE, data | {"columns": columns.to_dict()})

    def record_input(self, identity: dict[str, Any]) -> None:
        """Keeps `identity` as the input's in the fingerprint (a run whose input ended at a cut records the cut)."""
        data = read_json(self.path / FINGERPRINT_FILE) or {}
        data.setdefault("fingerprint", {})["input"] = identity
        write_json_atomic(self.path / FINGERPRINT_FILE, data)

    def end_redo(self) -> None:
        """The redo of the locked `directory` has written every request: its history says it is finished."""
        from cbgen.rows.redo import finish_redo

        data = read_json(self.path / FINGERPRINT_FILE) or {}
        if data.get("redos"):
            write_json_atomic(self.path / FINGERPRINT_FILE, finish_redo(data))

    def manifest(self) -> dict[str, Any] | None:
        """The run.json of the directory's last run, None before one has ended."""
        return read_json(self.path / MANIFEST_FILE)
