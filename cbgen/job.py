"""One generation job from input to output directory: the library entry point behind `cbgen run`.

A job is a pipeline of plain iterators, each stage in its own module:

    read      cbgen.inputs             rows -> PromptRecords (bad rows become error records)
    render    cbgen.prompts.Renderer   chat template, tokenizer -> Requests
    settings  cbgen.request_settings   the row's own sampling, caps and stop strings over the job's
    order     cbgen.prompts            prefix-aware order, longest generations first
    generate  cbgen.engine             transformers' continuous batching, a bounded window in flight
    write     cbgen.outputs            rows or OpenAI lines into atomic shards, resume index, run.json

This module only wires them together, resuming whatever the output directory already holds.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cbgen.config import JobConfig, page_size
from cbgen.errors import CbgenError
from cbgen.inputs import Reader, open_reader
from cbgen.model.source import ModelSource, resolve_source
from cbgen.outputs.manifest import job_fingerprint, write_manifest
from cbgen.outputs.rundir import MANIFEST_FILE, DoneIndex, open_run_directory, read_json, read_stored_run
from cbgen.outputs.writers import shard_paths
from cbgen.progress import NullProgress, ProgressSink, plural
from cbgen.prompts import LOOKAHEAD
from cbgen.records import Completion, PromptRecord, Request
from cbgen.sharding import Sharding, resolve_sharding, shard_directory, shard_of
from cbgen.startup import release_gc
from cbgen.summary import RunSummary, Status

if TYPE_CHECKING:
    from cbgen.distributed import TensorParallel
    from cbgen.engine.engine import Engine
    from cbgen.model.load import LoadedModel
    from cbgen.outputs.rows import OutputRows
    from cbgen.outputs.writers import ShardWriter


def run_job(job: JobConfig, progress: ProgressSink | None = None, stop: threading.Event | None = None,
            tp: TensorParallel | None = None) -> RunSummary:
    """Runs `job` to the end, or until `stop` is set, and returns its summary. A job whose output directory already
    holds part of its results resumes: finished requests are skipped, each request is written exactly once.
    With `tp` (cbgen.distributed), this is rank 0 of a tensor-parallel job: the other ranks run `follow`.
    Raises CbgenError for problems the user can fix."""
    try:
        return _run_job(job, progress or NullProgress(), stop or threading.Event(), tp)
    finally:
        if tp is not None:
            tp.release()  # followers waiting for a model to load or an engine to join go home


def _run_job(job: JobConfig, progress: ProgressSink, stop: threading.Event, tp: TensorParallel | None) -> RunSummary:
    started = time.perf_counter()
    if job.input.path is None:
        raise CbgenError("no input file given: cbgen run PROMPTS.jsonl (or - for stdin)")
    sharding = resolve_sharding(job)
    out_dir = shard_directory(Path(job.output.dir), sharding)
    stored = read_stored_run(out_dir) if out_dir.is_dir() and not job.output.overwrite else None
    # a directory written before rows' own `id` fields were taken as ids keeps numbering its rows
    reader = open_input(job, detect_id=stored is None or stored.detects_ids)
    source = resolve_source(job.model.model)
    progress.stage(f"checking {reader.name}")
    reader.check_ids()
    ids = {"column": reader.id_column, "chosen_by": reader.id_choice}
    lock, done = open_run_directory(out_dir, job_fingerprint(job, source, sharding), stored_job(job), ids,
                                    job.output.overwrite)
    with lock:
        summary = RunSummary(output_dir=out_dir, model=source.name, shard=sharding, ids=ids)
        summary.add_done(done)
        return _Run(job, reader, source, sharding, done, summary, progress, stop, started, tp).execute()


def open_input(job: JobConfig, *, detect_id: bool = True) -> Reader:
    """The reader for the job's input, with the job's input settings."""
    i = job.input
    return open_reader(i.path, prompt_column=i.prompt_column, id_column=i.id_column, keep_columns=i.keep_columns,
                       input_format=i.format, split=i.split, subset=i.subset, detect_id=detect_id,
                       max_line_bytes=i.max_line_bytes)


def stored_job(job: JobConfig) -> dict:
    """The configuration kept beside the fingerprint, with the input's absolute path, so that `cbgen status` and
    `cbgen merge` find it from any directory."""
    stored = job.to_dict()
    if Path(job.input.path).exists():
        stored["input"]["path"] = str(Path(job.input.path).resolve())
    return stored


@dataclass
class _Run:
    """One run of a job on its locked output directory."""

    job: JobConfig
    reader: Reader
    source: ModelSource
    sharding: Sharding | None
    done: DoneIndex
    summary: RunSummary
    progress: ProgressSink
    stop: threading.Event
    started: float
    tp: TensorParallel | None
    used: set[str] = field(default_factory=set)  # row settings the input uses
    steps: object = None  # cbgen.control.plan.StepPlan when the step control runs
    replies: object = None  # cbgen.chat.responses.ReplyParser when the model has a response template

    def execute(self) -> RunSummary:
        from cbgen.outputs.rows import OutputRows

        total = self._count_pending()
        if total == 0:
            return self._nothing_left()
        self.reader.on_notice = lambda message: self.progress.stage(f"note: {message}")  # said once each
        if self.reader.detected:
            self.progress.stage(f"input: {self.reader.detected}")
        records = (record for record in self.reader if self.wanted(record))
        head = list(itertools.islice(records, LOOKAHEAD))
        used = self.reader.settings_present()
        self.used = {name for r in head for name in r.settings} if used is None else used  # None: stdin
        g = self.job.generation
        top = bool(g.top_logprobs) or "top_logprobs" in self.used
        logprobs = g.logprobs or top or "logprobs" in self.used
        if len(head) < LOOKAHEAD and all(record.error is not None for record in head):
            # no row can run: each becomes its error record, and no model is loaded
            self._write(self._refused(head), OutputRows(self.job, None, self.source.name, logprobs, top), total)
            self._finish(None, None)
            return self.summary
        loaded = self._load_model()
        engine, ordered = self._prepare(loaded, total, head, records)
        rows = OutputRows(self.job, loaded.tokenizer, self.source.name, logprobs, top, self.replies)
        self._write(engine.run(ordered, self.stop), rows, total)
        self._finish(engine, loaded)
        return self.summary

    def _refused(self, records: list[PromptRecord]) -> Iterator[list[Completion]]:
        from cbgen.engine.admission import rejection

        n = self.job.generation.num_return_sequences
        for record in records:
            yield rejection(Request(record, error=record.error), record.error, n)

    def wanted(self, record: PromptRecord) -> bool:
        """Whether this run should generate `record`: in this shard, and not done by an earlier run."""
        if self.sharding is not None and shard_of(record.id, self.sharding[1]) != self.sharding[0]:
            return False
        return record.id not in self.done.ids

    def _count_pending(self) -> int | None:
        if self.sharding is not None or self.done.ids:
            total = sum(1 for record in self.reader if self.wanted(record)) if self.job.input.path != "-" else None
        else:
            total = self.reader.count()
        if self.done.requests:
            self.progress.stage(f"resuming: {plural(self.done.requests, 'request')} already done in "
                                f"{self.summary.output_dir}, {total} to go")
        return total

    def _nothing_left(self) -> RunSummary:
        self.progress.stage("nothing left to do")
        path = self.summary.output_dir / MANIFEST_FILE
        manifest = read_json(path)
        if manifest is None:
            write_manifest(self.summary, self.job, None, {})
        elif manifest.get("status") != Status.COMPLETE:  # stopped just after its last request: it is complete now
            from cbgen.files import write_json_atomic

            write_json_atomic(path, manifest | {"status": Status.COMPLETE})
        self.summary.timings["total_s"] = round(time.perf_counter() - self.started, 3)
        return self.summary

    def _load_model(self) -> LoadedModel:
        tp = self.tp
        # said before importing torch and transformers, which take seconds of their own
        self.progress.stage("loading the model" + (f" (tensor parallel over {tp.size} processes)" if tp else ""))
        from cbgen.distributed import LOAD
        from cbgen.model.load import load_model

        if tp is not None:
            tp.share(LOAD)
        loaded = load_model(self.job.model, tp)
        release_gc()  # the libraries and the model exist now: later collections skip them
        self.summary.timings["model_load_s"] = round(loaded.load_seconds, 3)
        return loaded

    def _prepare(self, loaded: LoadedModel, total: int | None, head: list[PromptRecord],
                 rest: Iterator[PromptRecord]) -> tuple[Engine, Iterator[Request]]:
        """Renders the records read ahead, plans the engine from them, and lines up the rest behind them."""
        from cbgen.chat.responses import ReplyParser, load_template, model_template
        from cbgen.control.plan import StepPlan
        from cbgen.engine.engine import Engine
        from cbgen.engine.plan import Workload, plan_engine
        from cbgen.prompts import Renderer, prefix_aware_order
        from cbgen.request_settings import RequestSettings
        from cbgen.sampling import SamplingPlan

        job = self.job
        text_config = loaded.model.config.get_text_config()
        template = model_template(loaded.tokenizer, getattr(loaded.model.config, "model_type", None),
                                  load_template(job.generation.response_template))
        self.replies = ReplyParser(loaded.tokenizer, template) if template is not None else None
        renderer = Renderer(loaded.tokenizer, vocab_size=text_config.vocab_size, raw_prompts=job.input.raw_prompts,
                            max_positions=getattr(text_config, "max_position_embeddings", None),
                            template_kwargs=job.generation.chat_template_kwargs,
                            finds_calls=template is not None and template.calls)
        self.progress.stage("rendering prompts")
        sampling = SamplingPlan.build(job, self.used, text_config.vocab_size)
        steps = StepPlan.build(job, self.used, loaded.tokenizer, text_config.vocab_size,
                               sampling.generation_fields()["do_sample"], template)
        steps = steps if steps.active else None
        prepare = RequestSettings(job, sampling, steps)
        requests = [prepare(renderer.render(record)) for record in head]
        workload = Workload.of(job, requests, total, whole=len(head) < LOOKAHEAD)
        wants_logprobs = job.generation.logprobs or bool({"logprobs", "top_logprobs"} & self.used)
        plan = plan_engine(job, loaded, workload, sampling, wants_logprobs, steps, job.run.data_parallel)
        self.steps = steps
        self.summary.kv_cache = plan.kv_cache
        self.summary.sampling = {"per_request": sampling.per_request, "stages": sorted(sampling.stages),
                                 "row_settings": sorted(self.used)}
        if self.tp is not None:  # the followers build the very same manager
            self.tp.share(copy.deepcopy(plan.spec))
        if job.run.data_parallel > 1:
            from cbgen.engine.replicas import pool_for

            engine = pool_for(job, loaded, plan)
            self.summary.replicas = {"count": job.run.data_parallel, "lost": engine.lost}
        else:
            decode = lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            engine = Engine(loaded.model, plan.engine_settings(job, decode=decode, restartable=self.tp is None))
        following = map(prepare, renderer.render_all(rest))
        ordered = prefix_aware_order(itertools.chain(requests, following), key_tokens=page_size(plan.batching),
                                     lookahead=LOOKAHEAD, default_max_new_tokens=job.generation.max_new_tokens)
        return engine, ordered

    def _open_writer(self, logprobs: bool, top_logprobs: bool, replies: bool = False) -> ShardWriter:
        from cbgen.outputs.writers import open_writer

        output = self.job.output
        return open_writer(output.format, self.summary.output_dir, rows_per_shard=output.rows_per_shard,
                           logprobs=logprobs, top_logprobs=top_logprobs, replies=replies,
                           kept_names=self.job.input.keep_columns, kept_schema=self.reader.kept_schema,
                           first_shard=self.done.next_shard)

    def _write(self, groups: Iterator[list[Completion]], rows: OutputRows, total: int | None) -> None:
        """Writes each request's rows as it finishes, commits on time, and stops on a signal or too many errors."""
        with self._open_writer(rows.logprobs, rows.top_logprobs, rows.replies is not None) as writer:
            self._write_all(groups, writer, rows, total)

    def _write_all(self, groups: Iterator[list[Completion]], writer: ShardWriter, rows: OutputRows,
                   total: int | None) -> None:
        job, summary, stop = self.job, self.summary, self.stop
        n = job.generation.num_return_sequences
        by_request = "n" in self.used  # rows with their own n: count requests, whose total is known
        self.progress.stage("starting the engine")
        if by_request:
            self.progress.start(total, "request")
        else:
            self.progress.start(total * n if total is not None else None, "sequence")
        started = last_commit = time.perf_counter()
        for group in groups:
            writer.write_group(rows(group))
            failed = summary.add_request(group)
            self.progress.advance(1 if by_request else len(group), group[0].num_prompt_tokens,
                                  sum(len(c.token_ids) for c in group), failed)
            if time.perf_counter() - last_commit >= job.run.commit_interval:
                writer.commit()
                last_commit = time.perf_counter()
            if job.run.max_errors is not None and summary.failed_requests > job.run.max_errors and not stop.is_set():
                summary.status = Status.TOO_MANY_ERRORS
                stop.set()
        if stop.is_set() and summary.status == Status.COMPLETE:
            summary.status = Status.STOPPED
        summary.timings["generation_s"] = round(time.perf_counter() - started, 3)

    def _finish(self, engine: Engine | None, loaded: LoadedModel | None) -> None:
        summary = self.summary
        summary.input_notices = dict(self.reader.notices)
        self.progress.finish()
        summary.shards = [p.name for _, p in shard_paths(summary.output_dir)]
        if self.steps is not None:
            grammars = self.steps.grammars
            summary.step_control = {
                "formats_compiled": grammars.compiled if grammars else 0,
                "compile_s": round(grammars.compile_seconds, 3) if grammars else 0.0,
                "logprobs": "the model's own (before sampling settings and formats)" if self.steps.capture else None,
                "top_logprobs": self.steps.top_logprobs,
                "draws": ("seeded per request" if self.steps.seeds else "per request") if self.steps.do_sample
                else "greedy",
            }
        if engine is not None:
            summary.engine_restarts = engine.stats.restarts
            summary.attention = engine.stats.attention if engine.stats.started else None
            summary.kv_cache.update(num_blocks=engine.stats.num_blocks)
        summary.timings["total_s"] = round(time.perf_counter() - self.started, 3)
        write_manifest(summary, self.job, loaded, dict(engine.stats.resolved_config) if engine else {})
