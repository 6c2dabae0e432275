"""Running a pipeline: each stage in order (or one, with --stage), each into OUT/<name>/, like make.

A stage is up to date when its output directory holds a complete run whose fingerprint is the one the stage has
now. A generate or score stage's fingerprint is its job's (cbgen.outputs.manifest) plus its lineage: for each stage
it reads, that stage's own fingerprint and the digest of its table. So a changed stage runs again, and so does every
stage after it; a stage stopped mid-way resumes row by row, exactly once, as `cbgen run` does; a stage whose
fingerprint changed starts over. Tables (cbgen.pipelines.tables) are written to OUT/.tables/ once the stage they
come from is complete, and are written again only when its shards change (a --redo).

An sql stage runs once every stage it reads is complete: its result is written to a staging folder, then put in
place of OUT/<name>/ whole, so a kill leaves the old result or none, never half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.errors import CbgenError, ExitCode
from cbgen.files import read_json_or_none, write_json_atomic
from cbgen.pipelines.checks import Overrides, StagePlan, plan_pipeline, stage_job
from cbgen.pipelines.spec import Pipeline, Stage
from cbgen.pipelines.status import PIPELINE_FILE, SQL_FILE
from cbgen.pipelines.tables import sha256

if TYPE_CHECKING:
    from cbgen.config import JobConfig
    from cbgen.model.pool import ModelPool
    from cbgen.outputs.collect import RunDirectory
    from cbgen.outputs.summary import RunSummary
    from cbgen.progress import ProgressSink

TABLES = ".tables"
FORMAT = 1


@dataclass
class StageOutcome:
    name: str
    kind: str
    state: str  # "up to date", "ran", "resumed", "stopped", ...
    rows: int | None = None
    failed: int = 0
    seconds: float = 0.0
    summary: RunSummary | None = None
    exit_code: int = ExitCode.OK

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.name, "kind": self.kind, "state": self.state, "rows": self.rows, "failed": self.failed,
                "seconds": round(self.seconds, 3), "exit_code": int(self.exit_code)}


@dataclass
class PipelineReport:
    output_dir: Path
    stages: list[StageOutcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> ExitCode:
        worst = [o.exit_code for o in self.stages if o.exit_code not in (ExitCode.OK, ExitCode.SOME_FAILED)]
        if worst:
            return ExitCode(worst[0])
        return ExitCode.SOME_FAILED if any(o.failed for o in self.stages) else ExitCode.OK

    def to_dict(self) -> dict[str, Any]:
        return {"output_dir": str(self.output_dir), "exit_code": int(self.exit_code), "notes": self.notes,
                "stages": [o.to_dict() for o in self.stages]}


@dataclass(frozen=True)
class Table:
    path: Path
    sha256: str
    rows: int


@dataclass(frozen=True)
class JobState:
    directories: tuple[RunDirectory, ...]  # those holding a run of the stage as it is now (the complete ones, if any)
    complete: bool
    stale: tuple[Path, ...]  # directories holding a run of the stage as it was before


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


class PipelineRun:
    """One run of a pipeline into `output_dir`. `extra`: overrides from the command line for the stage(s) run
    (sharding, --redo); `only`: run this stage alone (its inputs must be complete)."""

    def __init__(self, pipeline: Pipeline, output_dir: Path, *, only: str | None = None,
                 extra: Overrides | None = None, progress: Callable[[Stage], ProgressSink] | None = None,
                 say: Callable[[str], None] = lambda message: None, stop: threading.Event | None = None,
                 models: ModelPool | None = None) -> None:
        from cbgen.model.pool import ModelPool

        self.pipeline = pipeline
        self.output_dir = Path(output_dir)
        self.only = pipeline.stage(only).name if only is not None else None
        self.extra = extra or {}
        self.progress = progress
        self.say = say
        self.stop = stop or threading.Event()
        self.models = models or ModelPool()
        self.plans: dict[str, StagePlan] = {}
        self.job_of = cache(self._job_of)
        self.fingerprint = cache(self._fingerprint)
        self.signature = cache(self._signature)
        self.table = cache(self._table)

    # -- the whole run -------------------------------------------------------------------------------------------

    def run(self) -> PipelineReport:
        self.plans = plan_pipeline(self.pipeline, self.output_dir)  # everything checked before any model loads
        report = PipelineReport(self.output_dir, notes=[n for p in self.plans.values() for n in p.notes])
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.output_dir / PIPELINE_FILE, {"format": FORMAT, "file": self.pipeline.where,
                                                              **self.pipeline.to_dict()})
        for stage in self.pipeline.stages:
            if self.only is not None and stage.name != self.only:
                continue
            started = time.perf_counter()
            outcome = self._run_job(stage) if stage.of_kind.over_rows else self._run_sql(stage)
            outcome.seconds = time.perf_counter() - started
            report.stages.append(outcome)
            if outcome.exit_code not in (ExitCode.OK, ExitCode.SOME_FAILED):
                break  # stopped: what comes after needs all of it
        return report

    def _overrides(self, stage: Stage) -> Overrides:
        """The command line's overrides for `stage`, every one of them (--no-cache, --cache, ...): a whole pipeline
        runs unsplit, whatever the environment says (a Slurm array runs one stage at a time, with --stage)."""
        if self.only is not None and stage.name != self.only:
            return {}
        extra: Overrides = dict(self.extra)
        if self.only is None:
            extra |= {("run", "num_shards"): (1, "num_shards"), ("run", "shard_index"): (0, "shard_index")}
        given = extra.pop(("run", "redo"), None)
        redo: list[str] = list(given[0]) if given is not None else []
        kinds = stage.of_kind.redo_kinds(redo)
        has_run = any((self.output_dir / stage.name).glob("**/fingerprint.json"))  # a first run has nothing to redo
        return extra | ({("run", "redo"): (kinds, "redo")} if kinds and has_run else {})

    # -- generate and score stages -------------------------------------------------------------------------------

    def _job_of(self, name: str) -> tuple[JobConfig, dict[str, Any]]:
        """Stage `name`'s job (its input: a file, or the table of the stage it reads) and its lineage."""
        stage = self.pipeline.stage(name)
        assert stage.input is not None
        lineage: dict[str, Any] = {"stage": name, "upstream": {}}
        path = stage.input
        if stage.input_is_stage:
            table = self.table(stage.input)
            path = str(table.path)
            lineage["upstream"][stage.input] = {"fingerprint": self.signature(stage.input), "table": table.sha256}
        job = stage_job(self.pipeline, stage, path, self.output_dir, self.plans[name].carried, self._overrides(stage))
        return job, lineage

    def _fingerprint(self, name: str) -> dict[str, Any]:
        """Generate or score stage `name`'s fingerprint as it is now, without its sharding (which shards differ in)."""
        from cbgen.model.source import source_of
        from cbgen.outputs.manifest import job_fingerprint

        job, lineage = self.job_of(name)
        return job_fingerprint(job, source_of(job), None) | {"pipeline": lineage}

    def _signature(self, name: str) -> str:
        """A digest of what stage `name` is now: its fingerprint without its sharding."""
        stage = self.pipeline.stage(name)
        if not stage.of_kind.over_rows:
            return _digest(self._sql_fingerprint(stage))
        return _digest({k: v for k, v in self.fingerprint(name).items() if k != "shard"})

    def _job_state(self, name: str) -> JobState:
        from cbgen.outputs.collect import find_run_directories
        from cbgen.outputs.summary import Status
        from cbgen.rows.rundir import MANIFEST_FILE, read_json

        try:
            found = find_run_directories(self.output_dir / name)
        except CbgenError:
            return JobState((), False, ())
        job, _ = self.job_of(name)
        current = {k: v for k, v in self.fingerprint(name).items() if k != "shard"}

        def same(directory: RunDirectory) -> bool:
            stored = {k: v for k, v in directory.fingerprint.items() if k != "shard"}
            if job.run.redo:  # a redo runs with the generation settings it is given
                stored, now = ({k: v for k, v in d.items() if k != "generation"} for d in (stored, current))
                return stored == now
            return stored == current

        fresh = tuple(d for d in found if same(d))
        stale = tuple(d.path for d in found if not same(d))
        done = [d for d in fresh if (read_json(d.path / MANIFEST_FILE) or {}).get("status") == Status.COMPLETE]
        whole = [d for d in done if d.shard is None]
        if whole:
            return JobState(tuple(whole), True, stale)
        counts = {d.shard[1] for d in done if d.shard is not None}
        if len(counts) == 1:
            count = counts.pop()
            shards = [d for d in done if d.shard is not None and d.shard[1] == count]
            if len(shards) == count:
                return JobState(tuple(shards), True, stale)
        return JobState(fresh, False, stale)

    def _run_job(self, stage: Stage) -> StageOutcome:
        from cbgen.job.run import run_job
        from cbgen.parallel.sharding import resolve_sharding

        job, lineage = self.job_of(stage.name)
        state = self._job_state(stage.name)
        if state.complete and not job.run.redo:
            self.say(f"stage {stage.name!r} ({stage.kind}): up to date")
            return StageOutcome(stage.name, stage.kind, "up to date", rows=self.table(stage.name).rows
                                if self.pipeline.readers(stage.name) else None)
        from cbgen.parallel.sharding import shard_directory

        directory = self.output_dir / stage.name
        sharding = resolve_sharding(job)
        if state.stale and self.only is None:  # the whole stage starts over
            self.say(f"stage {stage.name!r} ({stage.kind}): its settings or inputs changed, starting over")
            shutil.rmtree(directory, ignore_errors=True)
        elif shard_directory(directory, sharding) in state.stale:  # one shard of a split run replaces only its own
            job = dataclasses.replace(job, output=dataclasses.replace(job.output, overwrite=True))
        if sharding is None and self.only is None and any(d.shard for d in state.directories):
            return self._finish_shards(stage, job, lineage, state)
        self.say(f"stage {stage.name!r} ({stage.kind}): {'resuming' if directory.exists() else 'running'}")
        summary = run_job(job, self._progress(stage), self.stop, models=self.models, lineage=lineage)
        return self._outcome(stage, summary)

    def _finish_shards(self, stage: Stage, job: JobConfig, lineage: dict[str, Any], state: JobState
                       ) -> StageOutcome:
        """A stage split into shards (by --stage runs) that is not complete: its shards run here, one by one."""
        from cbgen.job.run import run_job

        count = max(d.shard[1] for d in state.directories if d.shard is not None)
        outcome = StageOutcome(stage.name, stage.kind, "ran")
        for index in range(count):
            shard = dataclasses.replace(job, run=dataclasses.replace(job.run, num_shards=count, shard_index=index))
            self.say(f"stage {stage.name!r} ({stage.kind}): shard {index + 1} of {count}")
            summary = run_job(shard, self._progress(stage), self.stop, models=self.models, lineage=lineage)
            done = self._outcome(stage, summary)
            outcome.rows = (outcome.rows or 0) + (done.rows or 0)
            outcome.failed += done.failed
            outcome.exit_code = done.exit_code
            if done.exit_code not in (ExitCode.OK, ExitCode.SOME_FAILED):
                break
        return outcome

    def _progress(self, stage: Stage) -> ProgressSink:
        from cbgen.progress import NullProgress

        return self.progress(stage) if self.progress is not None else NullProgress()

    def _outcome(self, stage: Stage, summary: RunSummary) -> StageOutcome:
        state = "ran" if summary.exit_code in (ExitCode.OK, ExitCode.SOME_FAILED) else str(summary.status)
        return StageOutcome(stage.name, stage.kind, state, rows=summary.requests, failed=summary.failed,
                            summary=summary, exit_code=summary.exit_code)

    # -- tables --------------------------------------------------------------------------------------------------

    def _table(self, name: str) -> Table:
        """Stage `name`'s table (cbgen.pipelines.tables), written when missing or when the stage's shards changed."""
        from cbgen.rows.shards import shard_paths

        stage = self.pipeline.stage(name)
        if not stage.of_kind.over_rows:
            if not self._sql_fresh(stage):
                raise CbgenError(f"stage {name!r} has not run yet (or changed since): run it first "
                                 f"(cbgen pipeline {self.pipeline.where} --stage {name})")
            files = [p for _, p in shard_paths(self.output_dir / name)]
            state = None
        else:
            state = self._job_state(name)
            if not state.complete:
                raise CbgenError(f"stage {name!r} is not complete: run it first (cbgen pipeline "
                                 f"{self.pipeline.where} --stage {name}); `cbgen status {self.output_dir}` shows "
                                 "what it lacks")
            files = [p for d in state.directories for _, p in shard_paths(d.path)]
        source = _digest([self.signature(name)] + [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files])
        target = self.output_dir / TABLES / f"{name}.parquet"
        sidecar = target.with_suffix(".json")
        known = read_json_or_none(sidecar)
        if isinstance(known, dict) and known.get("source") == source and target.exists():
            return Table(target, known["sha256"], known["rows"])
        rows = self._write_table(stage, files, target, state)
        table = Table(target, sha256(target), rows)
        write_json_atomic(sidecar, {"source": source, "sha256": table.sha256, "rows": rows})
        return table

    def _write_table(self, stage: Stage, files: list[Path], target: Path, state: JobState | None) -> int:
        import pyarrow.parquet as pq

        from cbgen.outputs.dataset import columns_of
        from cbgen.pipelines.tables import write_parquet, write_stage_table

        if state is None:  # an sql stage: its result as it is
            table = pq.read_table(files) if files else self.plans[stage.name].table.empty_table()
            write_parquet(table, target)
            return table.num_rows
        job, _ = self.job_of(stage.name)
        columns = columns_of(state.directories[0].path)
        assert columns is not None
        return write_stage_table(stage.name, job, columns, files, self._input_ids(stage, job, state), target)

    def _input_ids(self, stage: Stage, job: JobConfig, state: JobState) -> list[str]:
        """The ids of the stage's input rows, in input order."""
        from cbgen.outputs.collect import expected_ids

        if stage.input_is_stage:
            import pyarrow.parquet as pq

            return [str(i) for i in pq.read_table(job.input.path, columns=["id"]).column("id").to_pylist()]
        return list(expected_ids(state.directories[0].stored))

    # -- sql stages ----------------------------------------------------------------------------------------------

    def _sql_fingerprint(self, stage: Stage) -> dict[str, Any]:
        return {"kind": stage.kind, "query": stage.query, **({"read_files": True} if stage.read_files else {}),
                **({"settings": stage.settings} if stage.settings else {}),
                "upstream": {name: {"fingerprint": self.signature(name), "table": self.table(name).sha256}
                             for name in stage.tables}}

    def _sql_fresh(self, stage: Stage) -> bool:
        stored = read_json_or_none(self.output_dir / stage.name / SQL_FILE)
        try:
            return isinstance(stored, dict) and stored.get("fingerprint") == self._sql_fingerprint(stage)
        except CbgenError:
            return False  # a stage it reads is not complete

    def _run_sql(self, stage: Stage) -> StageOutcome:
        from cbgen.pipelines.sql import run_sql_stage

        if self._sql_fresh(stage):
            self.say(f"stage {stage.name!r} ({stage.kind}): up to date")
            stored = read_json_or_none(self.output_dir / stage.name / SQL_FILE) or {}
            return StageOutcome(stage.name, stage.kind, "up to date", rows=stored.get("rows"))
        self.say(f"stage {stage.name!r} ({stage.kind}): running")
        tables = {name: self.table(name).path for name in stage.tables}  # says which stage is not complete
        rows = run_sql_stage(stage, tables, self.output_dir, self._sql_fingerprint(stage))
        stored = read_json_or_none(self.output_dir / stage.name / SQL_FILE) or {}
        if "dropped" in stored:
            self.say(f"stage {stage.name!r}: {rows:,} rows kept, {stored['dropped']:,} duplicates dropped "
                     f"(listed in {stage.name}/duplicates.parquet)")
        return StageOutcome(stage.name, stage.kind, "ran", rows=rows)
