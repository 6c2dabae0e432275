"""Looking at finished or running jobs: `cbgen status` (how far a job is) and `cbgen merge` (one result from the
shards of a job split across Slurm array tasks)."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.config import InputSection
from cbgen.errors import CbgenError
from cbgen.files import write_json_atomic
from cbgen.inputs import open_input
from cbgen.inputs.scoring import ScoreFields
from cbgen.kinds import kind_of
from cbgen.outputs.card import write_card
from cbgen.parallel.sharding import parse_shard_directory, shard_directory, shard_of
from cbgen.rows.columns import OutputColumns
from cbgen.rows.order import rows_in_order
from cbgen.rows.rundir import (
    FINGERPRINT_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    DirectoryLock,
    StoredRun,
    read_json,
    read_stored_run,
    stored_columns,
)
from cbgen.rows.shards import done_index, read_shards, shard_paths
from cbgen.rows.writers import open_writer

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass
class RunDirectory:
    """One output directory of a job (the whole job, or one shard of it)."""

    path: Path
    stored: StoredRun  # the fingerprint, the job's configuration and where its ids came from
    shard: tuple[int, int] | None

    @property
    def job(self) -> dict[str, Any]:
        return self.stored.job

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.stored.fingerprint

    @property
    def split(self) -> tuple[int, int]:
        """Its (index, count) in a job split into shards; only asked of shard directories."""
        if self.shard is None:
            raise CbgenError(f"'{self.path}' is not a shard of a split job")
        return self.shard

    @property
    def columns(self) -> OutputColumns:
        """The columns of its rows, as the run recorded them (or as its first shard has them)."""
        return stored_columns(self.path, self.stored)


def find_run_directories(base: Path) -> list[RunDirectory]:
    """The run directories under `base`: `base` itself, or its `shard-IIIII-of-NNNNN` subdirectories."""
    base = Path(base)
    if not base.is_dir():
        raise CbgenError(f"'{base}' is not a directory; give the output directory of a cbgen run (-o)")
    candidates = [base] if (base / FINGERPRINT_FILE).is_file() else []
    candidates += sorted(p for p in base.iterdir() if parse_shard_directory(p) and p.is_dir())
    found = []
    for path in candidates:
        stored = read_stored_run(path)
        if stored is None:
            continue  # a shard that has not started yet
        found.append(RunDirectory(path, stored, parse_shard_directory(path) if path != base else None))
    if not found:
        raise CbgenError(f"'{base}' holds no cbgen run ({FINGERPRINT_FILE} or shard-*-of-* directories)")
    return found


def is_running(path: Path) -> bool:
    """True while a cbgen process holds the directory's lock."""
    if not (path / LOCK_FILE).exists():
        return False
    try:
        DirectoryLock(path).acquire().release()
    except CbgenError:
        return True
    return False


def expected_ids(stored: StoredRun, input_path: str | None = None) -> Iterator[str]:
    """The ids a job's input yields, read with the job's own input settings (and its way of choosing ids)."""
    settings = stored_input(stored)
    source = input_path or settings.path
    if source in (None, "-"):
        raise CbgenError("the job read its prompts from stdin, so cbgen cannot list them; pass --input FILE")
    for record in open_input(settings, path=source, detect_id=stored.detects_ids, score=stored_score(stored)):
        yield record.id


def stored_input(stored: StoredRun) -> InputSection:
    """The input settings a run directory's job was run with (those an older cbgen did not know take defaults)."""
    known = {f.name for f in dataclasses.fields(InputSection)}
    return InputSection(**{k: v for k, v in stored.job.get("input", {}).items() if k in known})


def stored_score(stored: StoredRun) -> ScoreFields | None:
    """What a job's rows gave besides a prompt (its input is read as its kind reads it); None for a generation
    job."""
    kind = kind_of(stored.job.get("kind"))
    return ScoreFields.of_kind(kind.name, (stored.job.get(kind.own_section) or {}) if kind.own_section else {})


@dataclass
class DirectoryStatus:
    path: Path
    shard: tuple[int, int] | None
    done: int
    failed: int
    expected: int | None
    running: bool
    status: str | None  # from run.json: complete / stopped / ..., None while running or after a kill
    columns: tuple[str, ...] | None = None  # its rows' columns; None before its first run has planned
    cache: dict[str, Any] | None = None  # its last run's result-cache counts (run.json), when the cache was on

    @property
    def remaining(self) -> int | None:
        return None if self.expected is None else self.expected - self.done

    @property
    def state(self) -> str:
        """running, complete, incomplete, not started, or what run.json says (stopped, ...), else unknown."""
        if self.running:
            return "running"
        if self.remaining == 0:
            return "complete"
        if self.remaining is None or self.status == "not started":
            return self.status or "unknown"
        return "incomplete"

    def to_dict(self) -> dict[str, Any]:
        return {"directory": str(self.path), "shard": list(self.shard) if self.shard else None, "done": self.done,
                "failed": self.failed, "remaining": self.remaining, "state": self.state,
                "columns": list(self.columns) if self.columns is not None else None, "cache": self.cache}

    @property
    def from_cache(self) -> str:
        """The requests its last run took from the result cache, for the status table."""
        if not self.cache:
            return "-"
        hits = self.cache.get("hits", 0) + self.cache.get("near_hits", 0)
        return f"{hits}/{hits + self.cache.get('misses', 0)}"


def job_status(base: Path, input_path: str | None = None) -> list[DirectoryStatus]:
    """Done / failed / remaining requests of every run directory under `base`."""
    directories = find_run_directories(base)
    count = directories[0].shard[1] if directories[0].shard else None
    expected = _expected_counts(directories[0].stored, count, input_path)
    result = []
    for directory in directories:
        done = done_index(shard_paths(directory.path))
        key = directory.shard[0] if directory.shard else None
        manifest = read_json(directory.path / MANIFEST_FILE) or {}
        known = directory.stored.columns is not None or done.next_shard > 0
        result.append(DirectoryStatus(directory.path, directory.shard, done.requests, done.failed_requests,
                                      expected[key] if expected is not None else None,
                                      is_running(directory.path), manifest.get("status"),
                                      directory.columns.names if known else None, _cache_counts(manifest)))
    if count:
        started = {d.shard[0] for d in directories if d.shard}
        for index in sorted(set(range(count)) - started):
            path = shard_directory(base, (index, count))
            result.append(DirectoryStatus(path, (index, count), 0, 0,
                                          expected[index] if expected is not None else None, False, "not started"))
    return sorted(result, key=lambda r: r.shard or (0, 0))


def _cache_counts(manifest: dict[str, Any]) -> dict[str, Any] | None:
    cache = manifest.get("result_cache")
    if not isinstance(cache, dict) or not cache.get("on"):
        return None
    return {key: cache.get(key, 0) for key in ("hits", "near_hits", "misses", "not_cached")}


def _expected_counts(stored: StoredRun, count: int | None, input_path: str | None) -> Counter[int | None] | None:
    """How many requests the input has for each shard (under None for an unsplit job); None when the input is gone
    or was stdin, so that what remains is unknown."""
    expected: Counter[int | None] = Counter()
    try:
        for request_id in expected_ids(stored, input_path):
            expected[shard_of(request_id, count) if count else None] += 1
    except CbgenError:
        return None
    return expected


@dataclass
class MergeReport:
    output: Path | None
    rows: int = 0
    missing: dict[int, list[str]] = field(default_factory=dict)  # shard index -> missing ids
    duplicated: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shards_not_started: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected)

    def to_dict(self) -> dict[str, Any]:
        return {"merged": self.complete, "output": str(self.output) if self.output else None, "rows": self.rows,
                "missing": {str(shard): ids for shard, ids in sorted(self.missing.items())},
                "duplicated": self.duplicated, "unexpected": self.unexpected,
                "shards_not_started": self.shards_not_started}


def merge_shards(base: Path, output: Path | None = None, input_path: str | None = None,
                 to_dataset: bool = False) -> MergeReport:
    """Checks that every input id is present exactly once (with all its sequences) across the shards of a job,
    then writes them into one directory (default BASE/merged) in shard order, as shards of the job's format or,
    with `to_dataset`, as a Hugging Face dataset (`datasets.load_from_disk`). Nothing is written when an id is
    missing or repeated: the report says which ones, and which shard should hold them. A job that was not split
    needs no merging, but can still be turned into a dataset."""
    base = Path(base)
    found = find_run_directories(base)
    directories = sorted((d for d in found if d.shard is not None), key=lambda d: d.split[0])
    if not directories and to_dataset:
        return _whole_job_to_dataset(found[0], Path(output) if output else base / "merged", input_path)
    if not directories:
        raise CbgenError(f"'{base}' holds no shard-*-of-* directories: only a job run with --num-shards (or as a "
                         "Slurm array) needs merging")
    positions = {request_id: i for i, request_id in enumerate(expected_ids(directories[0].stored, input_path))}
    report = check_shards(base, directories, positions)
    if not report.complete:
        return report
    target = Path(output) if output else base / "merged"
    if target.exists() and any(target.iterdir()):
        raise CbgenError(f"merge target '{target}' is not empty; remove it or choose another with -o")
    job = directories[0].job
    if to_dataset:
        report.rows = save_dataset(directories, target, job, positions)
    else:
        report.rows = _copy_rows(directories, target, job, positions)
    report.output = target
    return report


def check_shards(base: Path, directories: list[RunDirectory], positions: dict[str, int]) -> MergeReport:
    """Which input ids (`positions`: each with its place in the input) the shards of one split job miss, repeat, or
    hold without the input having them."""
    counts = {d.split[1] for d in directories}
    if len(counts) > 1:
        raise CbgenError(f"'{base}' mixes jobs split {sorted(counts)} ways; merge one split at a time")
    num_shards = counts.pop()
    reference = {k: v for k, v in directories[0].fingerprint.items() if k != "shard"}
    for directory in directories[1:]:
        if {k: v for k, v in directory.fingerprint.items() if k != "shard"} != reference:
            raise CbgenError(f"'{directory.path}' was written by a different job than '{directories[0].path}'")
    report = MergeReport(output=None)
    report.shards_not_started = sorted(set(range(num_shards)) - {d.split[0] for d in directories})
    seen: Counter[str] = Counter()  # requests: a request's first sequence (or its one error row)
    for directory in directories:
        for row in read_shards(directory.path, columns=["id", "sample_index"]):
            seen[row["id"]] += row.get("sample_index", 0) == 0  # score rows: one per id
    for request_id in positions:
        times = seen.pop(request_id, 0)
        if times == 0:
            report.missing.setdefault(shard_of(request_id, num_shards), []).append(request_id)
        elif times != 1:
            report.duplicated.append(request_id)
    report.unexpected = sorted(seen)
    return report


def _copy_rows(directories: list[RunDirectory], target: Path, job: dict[str, Any], positions: dict[str, int]) -> int:
    """Writes the shards' rows, in input order, as shards of the job's own format in `target`, with the columns the
    job's rows have, and the dataset card; returns how many."""
    rows = 0
    columns = shared_columns(directories)
    writer = open_writer(job["output"]["format"], target, rows_per_shard=job["output"]["rows_per_shard"],
                         columns=columns, kept_schema=_kept_schema([d.path for d in directories], columns))
    with writer:
        for row in rows_in_order([d.path for d in directories], positions):  # OpenAI lines are copied as they are
            writer.write(row)
            rows += 1
    write_json_atomic(target / MANIFEST_FILE, {"merged_from": [str(d.path) for d in directories], "rows": rows,
                                               "shards": [p.name for p in writer.shards], "job": job,
                                               "columns": columns.to_dict()})
    write_card(target, shards=[p.name for p in writer.shards], columns=columns, job=job, model=_model(directories),
               counts={"rows": rows}, command=sys.argv, in_order=True, merged_from=len(directories))
    return rows


def _model(directories: list[RunDirectory]) -> str | None:
    """The name the runs gave their model (run.json)."""
    manifest = read_json(directories[0].path / MANIFEST_FILE) or {}
    return (manifest.get("model") or {}).get("name")


def shared_columns(directories: list[RunDirectory]) -> OutputColumns:
    """The columns the rows of every directory of one job have; a CbgenError when they disagree."""
    columns = {d.path: d.columns for d in directories}
    first = directories[0].path
    for path, theirs in columns.items():
        if theirs != columns[first]:
            raise CbgenError(f"'{path}' has the columns {', '.join(theirs.names)} and '{first}' "
                             f"{', '.join(columns[first].names)}: they cannot be merged into one table")
    return columns[first]


def _kept_schema(directories: list[Path], columns: OutputColumns) -> pa.Schema | None:
    """The kept columns' Arrow types, from the first Parquet shard (None for JSONL: the writer infers them)."""
    first = next((p for d in directories for _, p in shard_paths(d)), None)
    if first is None or first.suffix != ".parquet" or not columns.kept:
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(first)
    return pa.schema([schema.field(name) for name in columns.kept])


def _whole_job_to_dataset(directory: RunDirectory, target: Path, input_path: str | None) -> MergeReport:
    statuses = job_status(directory.path, input_path)
    remaining = statuses[0].remaining if statuses else None
    if remaining:
        raise CbgenError(f"'{directory.path}' still has {remaining} requests to do; run the job again to finish it "
                         "before making a dataset of it")
    if target.exists() and any(target.iterdir()):
        raise CbgenError(f"dataset target '{target}' is not empty; remove it or choose another with -o")
    report = MergeReport(output=target)
    try:
        positions = {request_id: i for i, request_id in enumerate(expected_ids(directory.stored, input_path))}
    except CbgenError:
        positions = {}  # stdin: the rows as they are
    report.rows = save_dataset([directory], target, directory.job, positions)
    return report


def save_dataset(directories: list[RunDirectory], target: Path, job: dict[str, Any], positions: dict[str, int]
                 ) -> int:
    """Writes every row of `directories`' shards, in input order, as a dataset saved with `save_to_disk` at `target`;
    returns the number of rows. Rows stream through an Arrow file, so memory stays bounded. Column types are
    cbgen's output schema (token_ids: int32 lists, logprobs: float32 lists); kept columns keep the input's types
    (Parquet) or take the types of their first values (JSONL), and OpenAI lines take the types of their values."""
    import tempfile

    import datasets
    import pyarrow as pa

    from cbgen.process.quiet import quiet
    from cbgen.rows.schema import arrow_schema, for_arrow, infer_kept_schema

    paths = [d.path for d in directories]
    features, columns = None, None

    first = next((p for d in paths for _, p in shard_paths(d)), None)
    jsonl = first is not None and first.suffix == ".jsonl"

    def rows() -> Iterator[dict[str, Any]]:
        yield from for_arrow(rows_in_order(paths, positions), columns, jsonl)

    if job["output"]["format"] != "openai":
        import itertools

        columns = shared_columns(directories)
        kept = _kept_schema(paths, columns)
        if columns.kept and kept is None:  # JSONL shards: the types their first rows' values have
            kept = infer_kept_schema(itertools.islice(rows(), 1000), columns.kept)
        features = datasets.Features.from_arrow_schema(arrow_schema(columns, kept))
    with tempfile.TemporaryDirectory(prefix="cbgen-dataset-") as cache, quiet("datasets"):
        try:
            dataset = datasets.Dataset.from_generator(rows, features=features, cache_dir=cache)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
            raise CbgenError(f"the rows cannot form one dataset: {e}; write the job with --output-format parquet, "
                             "whose columns have one type each") from None
        dataset.save_to_disk(str(target))
        count = dataset.num_rows
    write_json_atomic(target / "cbgen_merge.json", {"merged_from": [str(p) for p in paths], "rows": count,
                                                    "job": job})
    write_card(target, shards=sorted(p.name for p in target.glob("*.arrow")), columns=columns, job=job,
               model=_model(directories), counts={"rows": count}, command=sys.argv, in_order=True,
               merged_from=len(directories), saved_to_disk=True)
    return count


