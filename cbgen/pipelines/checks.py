"""A pipeline checked whole before any model loads: each stage's job, the columns it reads and carries on, and the
schema of its table, inferred stage after stage from the inputs' schemas (cbgen.pipelines.tables).

What is checked here is what would stop a stage later: its settings (as `cbgen run` checks flags), its templates
against the columns its input will have (nested fields included), the columns a score stage scores, its model, and
every sql stage's query (DuckDB binds it over empty tables of the right types). Each error is one CbgenError naming
the pipeline file and the stage.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from cbgen.config import JobConfig, build_config
from cbgen.config.flat import flat_overrides
from cbgen.errors import CbgenError
from cbgen.job.runners import check_stage_input
from cbgen.kinds import kind_of
from cbgen.parallel.launch import launch_of
from cbgen.pipelines.spec import Pipeline, Stage
from cbgen.pipelines.tables import carried_columns, empty_file, infer_query, infer_stage_table, struct_fields

Overrides = dict[tuple[str, str], tuple[Any, str]]
SAMPLE_ROWS = 1000  # rows of a JSONL input read to infer its columns' types


@dataclass(frozen=True)
class StagePlan:
    stage: Stage
    table: pa.Schema  # what later stages read of it
    carried: tuple[str, ...] = ()  # generate and score: the input columns its rows keep
    notes: tuple[str, ...] = ()  # what the user should know (a column not carried on)


def stage_job(pipeline: Pipeline, stage: Stage, input_path: str, output_dir: Path, carried: tuple[str, ...],
              extra: Overrides | None = None) -> JobConfig:
    """The job of a generate or score stage: its keys, reading `input_path`, writing Parquet to OUT/<name>,
    keeping the `carried` columns; `extra` from the command line (sharding, --redo)."""
    overrides = flat_overrides(stage.settings, f"{pipeline.where}: stage {stage.name!r}: ",
                               stage.of_kind.own_section) | {
        ("input", "path"): (input_path, "input"),
        ("input", "keep_columns"): (list(carried), "keep_columns"),
        ("output", "dir"): (str(output_dir / stage.name), "output"),
        ("output", "format"): ("parquet", "output_format"),
    } | (extra or {})
    job = build_config(None, overrides, kind=stage.kind)
    launch_of(job, f"pipeline stage {stage.name!r}")
    return job


def plan_pipeline(pipeline: Pipeline, output_dir: Path) -> dict[str, StagePlan]:
    """Every stage's plan, in run order; raises CbgenError for the first stage that could not run."""
    plans: dict[str, StagePlan] = {}
    templates = _ResponseTemplates()
    with tempfile.TemporaryDirectory(prefix="cbgen-pipeline-") as stubs:
        for stage in pipeline.stages:
            try:
                if not stage.of_kind.over_rows:  # a query: its result's schema from DuckDB's own inference
                    assert stage.query is not None
                    schema = infer_query(stage.query, {name: plans[name].table for name in stage.tables},
                                         stage.read_files)
                    if stage.of_kind.drops_duplicates:  # the column it compares, there and of its type
                        from cbgen.pipelines.dedup import check_column

                        check_column(schema, stage.settings)
                    plans[stage.name] = StagePlan(stage, schema)
                else:
                    plans[stage.name] = _plan_job_stage(pipeline, stage, plans, output_dir, Path(stubs), templates)
            except CbgenError as e:
                prefix = f"{pipeline.where}: stage {stage.name!r}"
                message = str(e) if str(e).startswith(prefix) else f"{prefix}: {e}"
                raise CbgenError(message) from None
    return plans


class _ResponseTemplates:
    """Each generate stage's response template, as its run will decide it (cbgen.job.plan.response_template): from
    its model's tokenizer, loaded once per model (no weights)."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, tuple[Any, Any]] = {}

    def of(self, job: JobConfig) -> Any:
        import dataclasses
        import json

        from cbgen.job.plan import response_template
        from cbgen.model.load import load_tokenizer

        key = json.dumps(dataclasses.asdict(job.model), sort_keys=True)
        if key not in self._tokenizers:
            self._tokenizers[key] = load_tokenizer(job.model)
        return response_template(job, *self._tokenizers[key])


def _plan_job_stage(pipeline: Pipeline, stage: Stage, plans: Mapping[str, StagePlan], output_dir: Path,
                    stubs: Path, templates: _ResponseTemplates) -> StagePlan:
    from cbgen.job.plan import plan_columns
    from cbgen.model.source import check_available, source_of
    from cbgen.rows.columns import OutputColumns
    from cbgen.rows.schema import arrow_schema

    assert stage.input is not None
    if stage.input_is_stage:
        schema = plans[stage.input].table
        stub = empty_file(schema, stubs / f"{stage.input}.parquet")
        _checked_input(pipeline, stage, str(stub), output_dir, f"stage {stage.input!r}'s table")
    else:
        schema = _checked_input(pipeline, stage, stage.input, output_dir, None)
    carried, dropped = carried_columns(schema, OutputColumns(kind=stage.kind).reserved)
    if stage.name in carried:
        raise CbgenError(f"its input has a column named {stage.name!r} too, and its own fields take that name in "
                         "its table; rename the stage")
    job = stage_job(pipeline, stage, stage.input, output_dir, tuple(carried))
    _check_fields(job, schema)
    check_available(source_of(job))  # a model that cannot be found says so now
    from cbgen.inputs.settings import ROW_SETTINGS

    used = frozenset(c for c in schema.names if c in ROW_SETTINGS)
    # the columns a run of this stage writes, decided by the function the run uses, so later stages plan on them
    columns = plan_columns(job, used, templates.of(job) if stage.of_kind.generates else None)
    output = arrow_schema(columns, pa.schema([schema.field(c) for c in carried]))
    assert output is not None  # every kept column's type is known
    notes = tuple(f"stage {stage.name!r} does not carry column {c!r} of its input on: its own rows have a field of "
                  "that name" for c in dropped)
    return StagePlan(stage, infer_stage_table(stage.name, job, columns, output), tuple(carried), notes)


def _checked_input(pipeline: Pipeline, stage: Stage, path: str, output_dir: Path, described: str | None
                   ) -> pa.Schema:
    """Opens the stage's input (or an empty file of the schema it will have) as its job will, so that its checks
    run now; returns the input's schema. `described` names a stand-in file in messages."""
    from cbgen.inputs import open_input
    from cbgen.inputs.scoring import ScoreFields

    job = stage_job(pipeline, stage, path, output_dir, ())
    try:
        reader = open_input(job.input, score=ScoreFields.of(job))
    except CbgenError as e:
        raise CbgenError(str(e).replace(f"'{path}'", described) if described else str(e)) from None
    if reader.schema is not None:
        return reader.schema
    from cbgen.inputs.jsonl import JsonlReader
    from cbgen.rows.schema import infer_kept_schema

    if not isinstance(reader, JsonlReader):
        raise CbgenError(f"cannot tell the columns of '{path}': give a stage a JSONL or Parquet file, or a dataset")
    rows = [row for _, (_, row, _) in zip(range(SAMPLE_ROWS), reader.objects()) if row is not None]
    names = list(dict.fromkeys(key for row in rows for key in row))
    return infer_kept_schema(rows, names)


def _check_fields(job: JobConfig, schema: pa.Schema) -> None:
    """The fields the templates read inside struct columns (`{{ questions.text }}`), and a score stage's dotted
    columns, exist in the input's schema."""
    from cbgen.inputs.base import PROMPT_FIELDS
    from cbgen.inputs.scoring import CHOICES_FIELD
    from cbgen.render.templates import PromptTemplate

    template = PromptTemplate.from_input(job.input)
    check_stage_input(kind_of(job.kind), job, schema)  # what its runner checks of its input (a chat stage's user)
    for column, names in (template.attributes.items() if template is not None else ()):
        fields = struct_fields(schema, column) if column in schema.names else None
        for name in sorted(names):
            if fields is not None and name not in fields:
                raise CbgenError(f"the templates read {column}.{name}, and column {column!r} has no field {name!r}; "
                                 f"its fields are: {', '.join(fields)}")
    if kind_of(job.kind).takes_section("score"):
        prompted = template is not None or any(c in schema.names for c in PROMPT_FIELDS)
        completion = job.score.completion_column.split(".")[0]
        if prompted and not job.score.choices and CHOICES_FIELD not in schema.names \
                and completion not in schema.names:
            raise CbgenError(f"nothing to score: its rows have a prompt, but its input has no column {completion!r} "
                             f"(completion_column) nor {CHOICES_FIELD!r}, and the stage gives no choices; its columns "
                             f"are: {', '.join(schema.names)}")
        for flag, path in (("completion_column", job.score.completion_column), ("text_column", job.score.text_column)):
            head, _, rest = path.partition(".")
            fields = struct_fields(schema, head) if rest and head in schema.names else None
            if fields is not None and rest.split(".")[0] not in fields:
                raise CbgenError(f"{flag} {path!r}: column {head!r} has no field {rest.split('.')[0]!r}; its fields "
                                 f"are: {', '.join(fields)}")
