"""One job from input to output directory: the library entry point behind `cbgen run` and `cbgen score`.

A job is a pipeline of plain iterators, each stage in its own module:

    read      cbgen.inputs             rows -> PromptRecords (bad rows become error records)
    plan      cbgen.job.plan           what the input holds + the model -> one frozen JobPlan
    render    cbgen.render.prompts.Renderer   chat template, tokenizer -> Requests
    settings  cbgen.job.request_settings   the row's own sampling, caps and stop strings over the job's
    order     cbgen.render.prompts            prefix-aware order, longest generations first
    generate  cbgen.engine             transformers' continuous batching, a bounded window in flight
    write     cbgen.rows, cbgen.outputs   rows or OpenAI lines into atomic shards, resume index; run.json

A scoring job (cbgen score) reads, writes and resumes the same way, with cbgen.score's scorer in the engine's place
and score rows for output rows; an embed or reward job with cbgen.encoders' encoder (cbgen.job.encode).

This module only runs them, as the plan says, resuming whatever the output directory already holds. Under tensor
parallelism, rank 0 runs the job (`run_job`) and the other ranks follow it (cbgen.job.follow), serving the plan
rank 0 sends them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen import result_cache
from cbgen.config import JobConfig
from cbgen.errors import CbgenError
from cbgen.inputs import Reader
from cbgen.job.runners import runner_of
from cbgen.job.sequence import Planned, drain, make_engine, open_job_input, read_ahead
from cbgen.kernels.build import build_notice
from cbgen.kinds import Kind, kind_of
from cbgen.model.source import ModelSource, context_tokens, resolve_source
from cbgen.outputs.manifest import cut_identity, job_fingerprint, stored_job, write_manifest
from cbgen.outputs.summary import RunSummary, Status
from cbgen.parallel.sharding import Sharding, resolve_sharding, shard_directory, shard_of
from cbgen.process.startup import release_gc
from cbgen.progress import NullProgress, ProgressSink, plural
from cbgen.records import Completion, PromptRecord, Request
from cbgen.rows.columns import OutputColumns
from cbgen.rows.rundir import MANIFEST_FILE, RunDirectory

if TYPE_CHECKING:
    from cbgen.control.grammars import Grammars
    from cbgen.conversations.rows import ChatRows
    from cbgen.encoders.rows import EncodedRows
    from cbgen.engine.engine import Engine
    from cbgen.engine.job_plan import JobPlan
    from cbgen.engine.replicas import ReplicaPool
    from cbgen.model.load import LoadedModel
    from cbgen.model.pool import ModelPool
    from cbgen.parallel.tensor import TensorParallel
    from cbgen.rows.request_rows import OutputRows
    from cbgen.rows.writers import ShardWriter
    from cbgen.score.rows import ScoreRows

    # what a finished request becomes: generated rows (or OpenAI lines), scores, embeddings, rewards, conversations
    Rows = OutputRows | ScoreRows | EncodedRows | ChatRows


def run_job(job: JobConfig, progress: ProgressSink | None = None, stop: threading.Event | None = None,
            tp: TensorParallel | None = None, *, models: ModelPool | None = None,
            lineage: dict[str, Any] | None = None) -> RunSummary:
    """Runs `job` to the end, or until `stop` is set, and returns its summary. A job whose output directory already
    holds part of its results resumes: finished requests are skipped, each request is written exactly once.
    With `tp` (cbgen.parallel.tensor), this is rank 0 of a tensor-parallel job: the other ranks run `follow_job`.
    `models` shares loaded models between jobs (a pipeline's stages); `lineage` joins the job's fingerprint (a
    pipeline stage's upstream stages), so that a change there makes this a different job.
    Raises CbgenError for problems the user can fix."""
    try:
        summary = _run_job(job, progress or NullProgress(), stop or threading.Event(), tp, models, lineage)
    except BaseException as error:
        if tp is not None:
            tp.end(error)  # followers still waiting for a message exit with this one
        raise
    if tp is not None:
        tp.end()  # a run that needed no model: followers waiting for one go home
    return summary


def _run_job(job: JobConfig, progress: ProgressSink, stop: threading.Event, tp: TensorParallel | None,
             models: ModelPool | None, lineage: dict[str, Any] | None) -> RunSummary:
    started = time.perf_counter()
    if job.input.path is None:
        raise CbgenError("no input file given: cbgen run PROMPTS.jsonl (or - for stdin)")
    sharding = resolve_sharding(job)
    output_dir = shard_directory(Path(job.output.dir), sharding)
    directory = RunDirectory(output_dir, overwrite=job.output.overwrite, same_input=job.input.same_input)
    stored = directory.stored
    embedded = kind_of(job.kind).embedded  # the model a job without --model runs: its kind's
    source = resolve_source(job.model.model, embedded)
    context = context_tokens(source)
    progress.stage(f"checking {'<stdin>' if job.input.path == '-' else job.input.path}")
    # a directory written before rows' own `id` fields were taken as ids keeps numbering its rows
    reader = open_job_input(job, context, detect_id=stored is None or stored.detects_ids, stop=stop,
                            on_notice=lambda message: progress.stage(f"note: {message}"))  # said once each
    fingerprint = job_fingerprint(job, source, sharding) | ({"pipeline": lineage} if lineage is not None else {})
    cut = (stored.fingerprint.get("input") or {}).get("cut_at_bytes") if stored is not None else None
    if isinstance(cut, int) and Path(job.input.path).is_file() and Path(job.input.path).stat().st_size >= cut:
        fingerprint["input"] = cut_identity(job.input.path, cut)  # the earlier run's input ended at a cut
    with directory.open(fingerprint, stored_job(job), reader.ids.to_dict(), job.run.redo):
        summary = RunSummary(output_dir=directory.path, model=source.name, shard=sharding, ids=reader.ids,
                             kind=job.kind, max_new_tokens=job.generation.max_new_tokens)
        summary.add_done(directory.done)
        return _Run(job, reader, source, sharding, directory, summary, progress, stop, started, tp, models).execute()


@dataclass
class _Run:
    """One run of a job on its locked output directory: reads ahead, plans, then executes the plan."""

    job: JobConfig
    reader: Reader
    source: ModelSource
    sharding: Sharding | None
    directory: RunDirectory  # opened: locked, its done requests read
    summary: RunSummary
    progress: ProgressSink
    stop: threading.Event
    started: float
    tp: TensorParallel | None
    models: ModelPool | None = None

    @property
    def kind(self) -> Kind:
        return kind_of(self.job.kind)

    def execute(self) -> RunSummary:
        from cbgen.job.plan import used_settings

        total = self._count_pending()
        if total == 0:
            return self._nothing_left()
        if self.reader.detected:
            self.progress.stage(f"input: {self.reader.detected}")
        records = (record for record in self.reader if self.wanted(record))
        head, whole = read_ahead(records)
        if self.stop.is_set():  # stopped while reading ahead (a template's render ends at once): no model loads
            self.summary.status = Status.STOPPED
            self._finish(None, None, None, None)
            return self.summary
        used = used_settings(self.reader.settings_present(), head)
        self.summary.row_settings = used
        if whole and all(record.error is not None for record in head):
            self._refuse_all(head, used, total)  # no row can run: no model is loaded
            return self.summary
        return runner_of(self.kind).execute(self, head, records, used, total, whole)

    def generate(self, loaded: LoadedModel, planned: Planned, rows: Rows, total: int | None,
                  stream: Callable[[Callable[[Iterator[Any]], Iterator[list[Completion]]]], Iterator[Any]]) -> None:
        """Runs the plan's engine on the requests `stream` hands it (through the result cache), writing `rows`."""
        plan = planned.plan
        self.directory.record_columns(plan.columns)
        self.summary.record_plan(plan)
        if self.tp is not None:  # the followers build the very same manager
            from cbgen.parallel.tensor import PLAN

            self.tp.send(PLAN, plan)
        engine = make_engine(self.job, planned, loaded, restartable=self.tp is None)
        from cbgen.engine.replicas import ReplicaPool

        if isinstance(engine, ReplicaPool):
            self.summary.replicas = {"count": len(engine.specs), "lost": engine.lost}
        self.progress.watch(engine.live, self.job.generation.max_new_tokens)
        cache = result_cache.for_generation(self.job, loaded, plan)
        self._write(stream(lambda rs: result_cache.through(cache, rs, lambda them: engine.run(them, self.stop))),
                    rows, total)
        self.summary.result_cache = result_cache.report(cache, self.job)
        self._finish(plan, engine, loaded, planned.grammars)

    def score(self, loaded: LoadedModel, records: Iterator[PromptRecord], total: int | None) -> RunSummary:
        """A scoring job: the scorer in the engine's place, score rows for output rows (cbgen.score)."""
        from cbgen.job.sequence import make_scorer, plan_scores, score_rows

        planned = plan_scores(self.job, loaded, records)
        self.directory.record_columns(planned.columns)
        self.summary.record_scope(planned.scope)
        scorer = make_scorer(self.job, loaded, planned.scope, self.job.generation.top_logprobs or 0)
        cache = result_cache.for_scoring(self.job, loaded, planned.scope)
        self._write(result_cache.through(cache, planned.requests, lambda rs: scorer.run(rs, self.stop), scores=True),
                    score_rows(planned.columns, loaded), total)
        self.summary.scorer = scorer.stats.to_dict()
        self.summary.result_cache = result_cache.report(cache, self.job)
        self._finish(None, None, loaded, None)
        self.input_cut()
        return self.summary

    def encode(self, records: Iterator[PromptRecord], total: int | None) -> RunSummary:
        """An embed or reward job: the encoder in the engine's place (cbgen.job.encode)."""
        from cbgen.encoders.load import load_encoder
        from cbgen.job.encode import plan_encoding

        self.progress.stage("loading the model")
        loaded = load_encoder(self.job)
        release_gc()
        self.summary.timings["model_load_s"] = round(loaded.load_seconds, 3)
        planned = plan_encoding(self.job, loaded, records)
        self.directory.record_columns(planned.columns)
        self._write((g for g in planned.encoder.run(planned.requests, self.stop)), planned.rows, total)
        self.summary.scorer = planned.encoder.stats.to_dict()
        self._finish(None, None, None, None)
        self.input_cut()
        return self.summary

    def input_cut(self) -> None:
        """After a run whose input ended at a cut (a truncated gzip file): the rows before it are written; the run
        records the cut file as its input, so that the file made whole resumes it, and says so (exit 2)."""
        broken = self.reader.broken
        if broken is None:
            return
        self.directory.record_input(cut_identity(str(self.job.input.path)))
        raise CbgenError(f"{broken}; the {plural(self.summary.run_requests, 'request')} read before the cut are "
                         "written: make the file whole (fetch it again) and rerun the same command to resume")

    def wanted(self, record: PromptRecord) -> bool:
        """Whether this run should generate `record`: in this shard, and not done by an earlier run."""
        if self.sharding is not None and shard_of(record.id, self.sharding[1]) != self.sharding[0]:
            return False
        return record.id not in self.directory.done.ids

    def _count_pending(self) -> int | None:
        if self.sharding is not None or self.directory.done.ids:
            total = sum(1 for record in self.reader if self.wanted(record)) if self.job.input.path != "-" else None
        else:
            total = self.reader.count()
        if self.directory.done.requests:
            self.progress.stage(f"resuming: {plural(self.directory.done.requests, 'request')} already done in "
                                f"{self.summary.output_dir}, {total} to go")
        return total

    def _nothing_left(self) -> RunSummary:
        self.progress.stage("nothing left to do")
        if self.job.run.redo:
            self.directory.end_redo()
        self._settle(complete=True)
        manifest = self.directory.manifest()
        if manifest is None:
            write_manifest(self.summary, self.job, None, {})
        elif manifest.get("status") != Status.COMPLETE:  # stopped just after its last request: it is complete now
            from cbgen.files import write_json_atomic

            write_json_atomic(self.directory.path / MANIFEST_FILE, manifest | {"status": Status.COMPLETE})
        self.summary.timings["total_s"] = round(time.perf_counter() - self.started, 3)
        return self.summary

    def _refuse_all(self, head: list[PromptRecord], used: frozenset[str], total: int | None) -> None:
        """Every row read is an error record, and there are no more: they are written without a model."""
        from cbgen.engine.admission import rejection

        columns = OutputColumns.decide(self.job, used, replies=False)
        self.directory.record_columns(columns)
        n = self.kind.samples_per_row(self.job)
        refused = (rejection(Request(r, error=r.error), r.error or "refused", n) for r in head)
        self._write(refused, runner_of(self.kind).refused_rows(self, columns), total)
        self._finish(None, None, None, None)

    def _settle(self, complete: bool) -> None:
        """The directory as a dataset: its rows in input order once every request is written, and its card."""
        from cbgen.outputs.dataset import settle

        if complete:
            self.progress.stage("putting the rows in input order")
        positions = self._input_positions() if complete else None
        self.summary.shards = settle(self.summary.output_dir, self.job, model=self.source.name,
                                     counts=self.summary.counts(), positions=positions,
                                     kept_schema=self.reader.kept_schema)

    def _input_positions(self) -> dict[str, int] | None:
        """Each of this run's ids with its position in the input; None for stdin, which cannot be read again."""
        if self.job.input.path == "-":
            return None
        positions: dict[str, int] = {}
        for record in self.reader:
            if self.sharding is None or shard_of(record.id, self.sharding[1]) == self.sharding[0]:
                positions.setdefault(record.id, len(positions))
        return positions

    def load_model(self) -> LoadedModel:
        tp = self.tp
        # said before importing torch and transformers, which take seconds of their own
        self.progress.stage("loading the model" + (f" (tensor parallel over {tp.size} processes)" if tp else ""))
        from cbgen.model.load import gguf_unconverted, load_model

        if tp is not None:
            from cbgen.parallel.tensor import LOAD

            tp.send(LOAD)
        # --data-parallel: the replicas load the weights; this process reads, renders and plans, which needs the
        # tokenizer and the model's structure only (unless a GGUF is still to convert: converted once, here, for all)
        replicas_only = self.job.run.data_parallel > 1 and self.kind.generates and self.models is None \
            and not gguf_unconverted(self.job.model)
        loaded = self.models.load(self.job.model) if self.models is not None and tp is None \
            else load_model(self.job.model, tp, weights=not replicas_only)
        release_gc()  # the libraries and the model exist now: later collections skip them
        self.summary.timings["model_load_s"] = round(loaded.load_seconds, 3)
        self.progress.stage((loaded.device == "cpu" and build_notice()) or "rendering prompts")
        return loaded

    def _open_writer(self, rows: Rows) -> ShardWriter:
        from cbgen.rows.writers import open_writer

        output = self.job.output
        return open_writer(output.format, self.summary.output_dir, rows_per_shard=output.rows_per_shard,
                           columns=rows.columns, kept_schema=self.reader.kept_schema,
                           first_shard=self.directory.done.next_shard)

    def _write(self, groups: Iterator[list[Completion]], rows: Rows, total: int | None) -> None:
        """Writes each request's rows as it finishes, commits on time, and stops on a signal or too many errors."""
        with self._open_writer(rows) as writer:
            self._write_all(groups, writer, rows, total)

    def _write_all(self, groups: Iterator[list[Completion]], writer: ShardWriter, rows: Rows,
                   total: int | None) -> None:
        job, summary, stop = self.job, self.summary, self.stop
        n = job.generation.num_return_sequences
        by_request = "n" in summary.row_settings  # rows with their own n: count requests, whose total is known
        self.progress.stage(self.kind.starting)
        unit = self.kind.unit or ("request" if by_request else "sequence" if self.kind.generates else "row")
        per_sequence = unit == "sequence"
        self.progress.start(total * n if per_sequence and total is not None else total, unit, verb=self.kind.verb)
        started = last_commit = time.perf_counter()

        def write(group: list[Completion]) -> None:
            nonlocal last_commit
            writer.write_group(rows(group))
            summary.add_request(group)
            if time.perf_counter() - last_commit >= job.run.commit_interval:
                writer.commit()
                last_commit = time.perf_counter()
            if job.run.max_errors is not None and summary.failed_requests > job.run.max_errors and not stop.is_set():
                summary.status = Status.TOO_MANY_ERRORS
                stop.set()

        drain(groups, self.progress, write, unit)
        if stop.is_set() and summary.status == Status.COMPLETE:
            summary.status = Status.STOPPED
        summary.timings["generation_s"] = round(time.perf_counter() - started, 3)

    def _finish(self, plan: JobPlan | None, engine: Engine | ReplicaPool | None, loaded: LoadedModel | None,
                grammars: Grammars | None) -> None:
        summary = self.summary
        summary.input_notices = dict(self.reader.notices)
        self.progress.finish()
        self._settle(complete=summary.status == Status.COMPLETE)
        if plan is not None and plan.steps is not None:
            summary.record_step_control(plan.steps, grammars)
        if engine is not None and plan is not None:
            summary.engine_restarts = engine.stats.restarts
            summary.attention = summary.engine_scope["attention"] if engine.stats.started else None
            summary.kv_cache.update(num_blocks=engine.stats.num_blocks, resident=engine.stats.kv_resident,
                                    dense_attention_mask=summary.engine_scope["dense_attention_mask"])
        summary.timings["total_s"] = round(time.perf_counter() - self.started, 3)
        if self.job.run.redo and summary.status == Status.COMPLETE:
            self.directory.end_redo()
        write_manifest(summary, self.job, loaded, dict(engine.stats.resolved_config) if engine else {})
