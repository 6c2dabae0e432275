"""The run sequence, written once: read → plan → render → order → run → write.

    open_job_input   the job's reader, with its rendering budget and stop, ids checked
    read_ahead       the first LOOKAHEAD records, from which the job is planned
    plan_input       the head rendered and the job planned from it (cbgen.job.plan); the rest rendered as read
    prepared         each request's own settings over the job's, in prefix-aware order
    make_engine      the engine the plan describes (or its --data-parallel replicas)
    drain            each finished request handed on as it finishes, counted on the progress display

For a scoring job, plan_scores, make_scorer and score_rows take the place of plan_input, make_engine and
output_rows. A job over files (cbgen.job.run), `--dry-run` (cbgen.job.dry_run), `cbgen bench` (cbgen.bench.paths)
and the Python API (generate_in_memory, score_in_memory here) all run these same steps; pipelines run their stages
as jobs over files.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cbgen.config import JobConfig, page_size
from cbgen.inputs import Reader, open_input
from cbgen.inputs.base import IdChoice
from cbgen.inputs.scoring import ScoreFields
from cbgen.inputs.settings import row_settings
from cbgen.progress import ProgressSink
from cbgen.records import Completion, PromptRecord, Request, requests_of
from cbgen.render.prompts import LOOKAHEAD
from cbgen.render.templates import render_limits

if TYPE_CHECKING:
    from cbgen.control.grammars import Grammars
    from cbgen.engine.engine import Engine
    from cbgen.engine.job_plan import JobPlan
    from cbgen.engine.replicas import ReplicaPool
    from cbgen.engine.scope import ScopePlan
    from cbgen.model.load import LoadedModel
    from cbgen.rows.columns import OutputColumns
    from cbgen.rows.request_rows import OutputRows
    from cbgen.score.requests import ScoreRequest
    from cbgen.score.rows import ScoreRows
    from cbgen.score.scorer import Scorer


def open_job_input(job: JobConfig, context: int | None, *, detect_id: bool = True, stop: threading.Event | None = None,
                   on_notice: Callable[[str], None] | None = None, reader: Reader | None = None) -> Reader:
    """The job's reader (or `reader`, prompts handed over in Python), with the job's rendering budget (from the
    model's `context` in tokens, cbgen.model.source.context_tokens), the job's `stop` (a render in progress ends when
    it is set) and `on_notice` (told each input notice once), its ids checked. `detect_id`: see
    cbgen.inputs.base.Reader."""
    if reader is None:
        reader = open_input(job.input, detect_id=detect_id, score=ScoreFields.of(job))
    reader.render_limits, reader.stop, reader.on_notice = render_limits(job, context), stop, on_notice
    reader.row_settings = row_settings(job.model.adapter is not None)
    reader.check_ids()
    return reader


def read_ahead(records: Iterator[PromptRecord]) -> tuple[list[PromptRecord], bool]:
    """The records a job is planned from (the first LOOKAHEAD), and whether they are the whole input."""
    head = list(itertools.islice(records, LOOKAHEAD))
    return head, len(head) < LOOKAHEAD


@dataclass
class Planned:
    """A planned job, ready to run: its plan, every request rendered (the head, then the rest as they are read),
    and the grammars its formats compiled into."""

    plan: JobPlan
    requests: Iterator[Request]
    grammars: Grammars | None


def plan_input(job: JobConfig, loaded: LoadedModel, head: list[PromptRecord], rest: Iterator[PromptRecord],
               used: frozenset[str], total: int | None, ids: IdChoice, whole: bool | None = None) -> Planned:
    """Renders the records read ahead (`head`) and plans the job from what they and the input hold (`whole`: the
    head is the whole input; by default, when it is shorter than a read-ahead)."""
    whole = len(head) < LOOKAHEAD if whole is None else whole
    from cbgen.job.plan import InputFacts, plan_job, plan_rendering
    from cbgen.render.prompts import Renderer

    rendering = plan_rendering(job, loaded)
    renderer = Renderer(loaded.tokenizer, rendering.render)
    rendered = tuple(renderer.render(record) for record in head)
    facts = InputFacts(used, rendered, total, whole=whole, ids=ids)
    plan = plan_job(job, facts, loaded, rendering)
    grammars = plan.steps.make_grammars(loaded.tokenizer) if plan.steps is not None else None
    return Planned(plan, itertools.chain(rendered, renderer.render_all(rest)), grammars)


def prepared(job: JobConfig, planned: Planned, *, ordered: bool = True) -> Iterator[Request]:
    """The requests with their own settings applied, in prefix-aware order (in input order unless `ordered`)."""
    from cbgen.job.request_settings import RequestSettings
    from cbgen.render.prompts import prefix_aware_order

    requests = map(RequestSettings(job, planned.plan, planned.grammars), planned.requests)
    if not ordered:
        return requests
    return prefix_aware_order(requests, key_tokens=page_size(planned.plan.engine.batching),
                              lookahead=LOOKAHEAD, default_max_new_tokens=job.generation.max_new_tokens)


def drain(groups: Iterator[list[Completion]], progress: ProgressSink, consume: Callable[[list[Completion]], Any],
          unit: str = "sequence") -> None:
    """The one loop every run ends in: each finished request's completions (`groups`, as they finish) handed to
    `consume`, and counted on `progress` in `unit`s: one a sequence ("sequence"), else one a request. A request
    the result cache answered counts as done, not in the tokens per second (its tokens were not computed now)."""
    per_sequence = unit == "sequence"
    for group in groups:
        consume(group)
        computed = [r for r in requests_of(group) if r.answered is None]
        lengths = [len(c.token_ids) for c in group if c.request.answered is None]
        prompt = sum(next(c for c in group if c.request is r).num_prompt_tokens for r in computed)
        progress.advance(len(group) if per_sequence else 1, prompt, sum(lengths),
                         sum(c.finish_reason == "error" for c in group), lengths if per_sequence else ())


def make_engine(job: JobConfig, planned: Planned, loaded: LoadedModel, *, restartable: bool = True
                ) -> Engine | ReplicaPool:
    """The engine the plan describes, or its --data-parallel replicas."""
    if job.run.data_parallel > 1:
        from cbgen.engine.replicas import pool_for

        return pool_for(job, loaded.device, planned.plan)
    from cbgen.engine.engine import Engine

    return Engine.for_tokenizer(loaded.model, loaded.tokenizer, planned.plan.engine.settings,
                                grammars=planned.grammars, restartable=restartable)


def output_rows(job: JobConfig, plan: JobPlan, loaded: LoadedModel, model_name: str) -> OutputRows:
    """What each finished request becomes: rows with the plan's columns (or OpenAI lines)."""
    from cbgen.chat.responses import ReplyParser
    from cbgen.rows.request_rows import OutputRows

    replies = ReplyParser(loaded.tokenizer, plan.template) if plan.template is not None else None
    return OutputRows(job, plan.columns, loaded.tokenizer, model_name, replies)


@dataclass
class PlannedScores:
    """A planned scoring job: the columns of its rows, and every row rendered into what the scorer runs."""

    columns: OutputColumns
    requests: Iterator[ScoreRequest]
    scope: ScopePlan  # what the scorer runs with (cbgen.engine.scope)


def plan_scores(job: JobConfig, loaded: LoadedModel, records: Iterator[PromptRecord]) -> PlannedScores:
    """Renders a scoring job's records as `cbgen run` renders prompts, each with what it scores after them."""
    from cbgen.engine.setup import plan_scoring_scope
    from cbgen.job.plan import plan_rendering
    from cbgen.render.prompts import Renderer
    from cbgen.rows.columns import OutputColumns
    from cbgen.score.requests import ScoreRenderer

    renderer = ScoreRenderer(Renderer(loaded.tokenizer, plan_rendering(job, loaded).render))
    return PlannedScores(OutputColumns.decide(job, frozenset(), replies=False), renderer.render_all(records),
                         plan_scoring_scope(job, loaded))


def make_scorer(job: JobConfig, loaded: LoadedModel, scope: ScopePlan, top_logprobs: int) -> Scorer:
    """The scorer `scope` plans (its rows packed end to end through cbgen's compiled attention, in padded batches, or
    each alone: cbgen.score.scorer)."""
    from cbgen.model.adapters import job_adapters
    from cbgen.score.scorer import Scorer

    adapters = job_adapters(job)
    return Scorer(loaded.model, batch_tokens=job.score.batch_tokens, top_logprobs=top_logprobs, scope=scope,
                  adapter=adapters.default if adapters is not None else None)


def score_rows(columns: OutputColumns, loaded: LoadedModel | None) -> ScoreRows:
    from cbgen.score.rows import ScoreRows

    return ScoreRows(columns, loaded.tokenizer if loaded is not None else None)


def generate_in_memory(job: JobConfig, loaded: LoadedModel, prompts: Sequence[Any], progress: ProgressSink
                       ) -> list[dict[str, Any]]:
    """Every row for `prompts` (strings, message lists, row dicts, or a datasets.Dataset), generated on `loaded`
    with no file read or written, in input order (a prompt's sequences by sample index)."""
    from cbgen.inputs.memory import MemoryReader
    from cbgen.job.plan import used_settings
    from cbgen.model.source import context_tokens
    from cbgen.render.templates import PromptTemplate
    from cbgen.result_cache import for_generation, through

    job = replace(job, output=replace(job.output, format="jsonl"))  # rows, whatever format the files would have
    reader = MemoryReader(prompts, keep_columns=job.input.keep_columns, id_column=job.input.id_column,
                          template=PromptTemplate.from_input(job.input))
    open_job_input(job, context_tokens(loaded.source), reader=reader)
    records: Iterator[PromptRecord] = iter(reader)
    head, _ = read_ahead(records)
    planned = plan_input(job, loaded, head, records, used_settings(reader.settings_present(), head),
                         reader.count(), reader.ids)
    rows = output_rows(job, planned.plan, loaded, loaded.source.name)
    engine = make_engine(job, planned, loaded)
    progress.start(reader.count() * job.generation.num_return_sequences, "sequence")
    results: list[tuple[int, int, dict[str, Any]]] = []
    cache = for_generation(job, loaded, planned.plan)

    def keep(group: list[Completion]) -> None:
        index = group[0].request.record.index
        results.extend((index, row.get("sample_index", 0), row) for row in rows(group))

    drain(through(cache, prepared(job, planned), lambda requests: engine.run(requests, threading.Event())),
          progress, keep)
    progress.finish()
    results.sort(key=lambda item: item[:2])
    return [row for _, _, row in results]


def score_in_memory(job: JobConfig, loaded: LoadedModel, requests: Sequence[ScoreRequest], progress: ProgressSink,
                    top_logprobs: int = 0) -> list[Completion]:
    """Each of `requests` (token ids already: a context and what is scored after it) scored on `loaded`, with no file
    read or written, in their order; `top_logprobs` alternatives per scored token (the evaluation backend asks for
    one, to tell whether each token was the model's greedy choice). Runs through the result cache, as a job does."""
    from cbgen.engine.setup import plan_scoring_scope
    from cbgen.result_cache import for_scoring, through

    scope = plan_scoring_scope(job, loaded)
    scorer = make_scorer(job, loaded, scope, top_logprobs)
    found: dict[int, Completion] = {}
    progress.start(len(requests), "row", "scoring")
    cache = for_scoring(replace(job, generation=replace(job.generation, top_logprobs=top_logprobs or None)), loaded,
                        scope)

    def keep(group: list[Completion]) -> None:
        found[group[0].request.record.index] = group[0]

    drain(through(cache, iter(requests), lambda rs: scorer.run(rs, threading.Event()), scores=True), progress, keep,
          unit="row")
    progress.finish()
    return [found[request.request.record.index] for request in requests]
