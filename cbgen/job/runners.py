"""How a kind's rows run, one runner a way (a kind names its runner: cbgen.kinds.base.Kind.runner): what it checks
of a pipeline stage's input before anything runs, how a run executes its rows, and the rows it writes for rows
refused before any model loads. cbgen.job.run drives a run through the runner its kind names and compares no
runner's name; a new way of running rows is one class here and one registry line.

    engine         generate (and the pipelines' generate stages): transformers' continuous batching
    conversations  chat: turns of simulated conversations through the same engine
    scorer         score: cbgen.score's scorer in the engine's place
    encoder        embed, reward: cbgen.encoders' encoder, on a model of its own
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from cbgen.kinds import Kind

if TYPE_CHECKING:
    import pyarrow as pa

    from cbgen.config import JobConfig
    from cbgen.inputs import Reader
    from cbgen.model.load import LoadedModel
    from cbgen.model.source import ModelSource
    from cbgen.outputs.summary import RunSummary
    from cbgen.progress import ProgressSink
    from cbgen.records import PromptRecord
    from cbgen.rows.columns import OutputColumns
    from cbgen.rows.rundir import RunDirectory


class Run(Protocol):
    """What a runner is handed of a run (cbgen.job.run): the job and its locked output directory, and the steps
    every way of running shares (the model's load, the engine's generation, the write, the input's cut)."""

    job: JobConfig
    reader: Reader
    source: ModelSource
    directory: RunDirectory
    summary: RunSummary
    progress: ProgressSink
    stop: threading.Event

    def load_model(self) -> LoadedModel: ...

    def generate(self, loaded: LoadedModel, planned: Any, rows: Any, total: int | None,
                 stream: Callable[[Callable[[Iterator[Any]], Iterator[Any]]], Iterator[Any]]) -> None: ...

    def score(self, loaded: LoadedModel, records: Iterator[PromptRecord], total: int | None) -> RunSummary: ...

    def encode(self, records: Iterator[PromptRecord], total: int | None) -> RunSummary: ...

    def input_cut(self) -> None: ...


class Runner:
    """The engine's way: the model loads, the input is planned and rendered, and the engine generates."""

    name: ClassVar[str] = "engine"

    def check_input(self, job: JobConfig, schema: pa.Schema) -> None:
        """A pipeline stage's input schema, checked before any stage runs: nothing beyond the kind's own checks."""

    def execute(self, run: Run, head: list[PromptRecord], records: Iterator[PromptRecord], used: frozenset[str],
                total: int | None, whole: bool) -> RunSummary:
        from cbgen.job.sequence import output_rows, plan_input, prepared

        loaded = run.load_model()
        planned = plan_input(run.job, loaded, head, records, used, total, run.reader.ids, whole)
        run.generate(loaded, planned, output_rows(run.job, planned.plan, loaded, run.source.name), total,
                     lambda compute: compute(prepared(run.job, planned)))
        run.input_cut()
        return run.summary

    def refused_rows(self, run: Run, columns: OutputColumns) -> Any:
        from cbgen.rows.request_rows import OutputRows

        return OutputRows(run.job, columns, None, run.source.name)


class ConversationsRunner(Runner):
    """A chat stage: each row a conversation, its turns generated through the engine."""

    name = "conversations"

    def check_input(self, job: JobConfig, schema: pa.Schema) -> None:
        """The simulated user's templates parse and read columns the input has; its user turns column is one."""
        from cbgen.conversations.builder import check_conversation_columns

        check_conversation_columns(job, schema)

    def execute(self, run: Run, head: list[PromptRecord], records: Iterator[PromptRecord], used: frozenset[str],
                total: int | None, whole: bool) -> RunSummary:
        from cbgen.conversations.builder import simulated_user
        from cbgen.job.converse import plan_conversations
        from cbgen.job.sequence import Planned
        from cbgen.outputs.summary import Status
        from cbgen.progress import plural

        simulated_user(run.job.chat)  # its templates parse, before the model loads
        loaded = run.load_model()
        talks = plan_conversations(run.job, loaded, head, used, total, run.reader.ids, whole, run.stop,
                                   run.directory.path, run.directory.done.ids)
        if talks.conversations.resumed:
            run.progress.stage(f"resuming {plural(len(talks.conversations.resumed), 'conversation')} from the turns "
                               "an earlier run finished")
        run.generate(loaded, Planned(talks.plan, iter(()), None), talks.rows, total,
                     lambda compute: talks.conversations.run(itertools.chain(head, records), compute))
        talks.close(complete=run.summary.status == Status.COMPLETE)
        run.input_cut()
        return run.summary

    def refused_rows(self, run: Run, columns: OutputColumns) -> Any:
        from cbgen.conversations.rows import ChatRows

        return ChatRows(columns)


class ScorerRunner(Runner):
    """cbgen score: the scorer in the engine's place, score rows for output rows."""

    name = "scorer"

    def execute(self, run: Run, head: list[PromptRecord], records: Iterator[PromptRecord], used: frozenset[str],
                total: int | None, whole: bool) -> RunSummary:
        return run.score(run.load_model(), itertools.chain(head, records), total)

    def refused_rows(self, run: Run, columns: OutputColumns) -> Any:
        from cbgen.job.sequence import score_rows

        return score_rows(columns, None)


class EncoderRunner(Runner):
    """embed and reward: the encoder in the engine's place, on a model it loads itself."""

    name = "encoder"

    def execute(self, run: Run, head: list[PromptRecord], records: Iterator[PromptRecord], used: frozenset[str],
                total: int | None, whole: bool) -> RunSummary:
        return run.encode(itertools.chain(head, records), total)

    def refused_rows(self, run: Run, columns: OutputColumns) -> Any:
        from cbgen.encoders.rows import EncodedRows

        return EncodedRows(columns)


RUNNERS: dict[str, Runner] = {runner.name: runner for runner in (Runner(), ConversationsRunner(), ScorerRunner(),
                                                                  EncoderRunner())}


def runner_of(kind: Kind) -> Runner:
    """The runner `kind` names. Raises KeyError for a kind that runs no rows here (a pipeline's query stages)."""
    return RUNNERS[kind.runner]


def check_stage_input(kind: Kind, job: JobConfig, schema: pa.Schema) -> None:
    """A pipeline stage's input, checked by its runner where it has one (a query stage has none here)."""
    runner = RUNNERS.get(kind.runner)
    if runner is not None:
        runner.check_input(job, schema)

