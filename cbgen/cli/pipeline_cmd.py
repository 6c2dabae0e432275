"""`cbgen pipeline`: the stages of a pipeline file, each into its own output directory, like make."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from cbgen.cli._options import JOB_OPTIONS, with_options
from cbgen.cli.display import make_progress
from cbgen.cli.run import graceful_stop
from cbgen.errors import CbgenError, ExitCode

if TYPE_CHECKING:
    from cbgen.pipelines import Pipeline
    from cbgen.pipelines.runner import PipelineReport

EPILOG = (
    "[bold]The file[/bold]: a list of named stages, each a generate stage (any cbgen run key, flat: template, "
    "json_schema, max_new_tokens, num_return_sequences, ...), a score stage (cbgen score's keys: choices, "
    "completion_column, ...) or an sql stage (a DuckDB query over earlier stages by name); 'defaults:' holds keys "
    "every generate and score stage starts from. A stage's input is a file or dataset (relative to the pipeline "
    "file) or an earlier stage's name.\n\n"
    "  stages:\n"
    "    - {name: questions, kind: generate, input: seed.parquet, template: 'A question about {{ topic }}.'}\n"
    "    - {name: rated, kind: score, input: questions, choices: [' yes', ' no'],\n"
    "       template: 'Question: {{ questions.text }} Is it clear? Answer:'}\n"
    "    - {name: kept, kind: sql, query: \"SELECT * FROM rated WHERE rated.best_choice = ' yes'\"}\n\n"
    "[bold]What a stage reads[/bold] of an earlier one (as its input, or as a table in SQL): an id, the earlier "
    "stage's input columns carried on, and its own fields as one struct column named after it "
    "({{ questions.text }}, questions.parsed.question); its failed rows are left out. Each stage writes OUT/<name>/, "
    "the final one a dataset (card included: datasets.load_dataset(OUT/<name>) or cbgen.load).\n\n"
    "[bold]Resuming[/bold]: run it again. Finished stages are skipped; one stopped mid-way resumes row by row; a "
    "stage whose settings (or whose inputs) changed runs again, and so does every stage after it.\n\n"
    "[bold]Scale-out[/bold]: --stage NAME runs one stage (its inputs must be complete), with --num-shards and "
    "--shard-index or as a Slurm array, as cbgen run does; an sql stage runs once all shards of what it reads are "
    "done. examples/pipeline-slurm.sh chains the stages' arrays with dependencies.\n\n"
    "[bold]Exit codes[/bold]: 0 every stage ran (or was up to date) and no row failed · 1 some rows failed (they are "
    "in their stage's output with their error; the stages after it go on without them) · 2 a bad pipeline (an "
    "unknown stage, a cycle, an SQL error, a column no earlier stage gives), a setting or an input: nothing ran · 3 "
    "unexpected internal error (CBGEN_DEBUG=1 shows the traceback) · 4 a stage stopped after more than --max-errors "
    "failures · 75 stopped by SIGTERM or Ctrl-C: run it again to resume."
)

_KEYS = {("run", "num_shards"), ("run", "shard_index"), ("run", "redo"), ("run", "result_cache"), ("run", "cache"),
         ("run", "cache_max_size"), ("run", "cache_near_hits")}
PIPELINE_OPTIONS = [o for o in JOB_OPTIONS if (o.section, o.key) in _KEYS]


@with_options(PIPELINE_OPTIONS)
def pipeline(
    file: Annotated[str, typer.Argument(metavar="FILE", help="The pipeline file (YAML).", show_default=False)],
    output_dir: Annotated[str, typer.Option(
        "-o", "--output-dir", help="Where the stages write: OUT/<stage name>/ each.", metavar="OUT")] = "cbgen-out",
    stage: Annotated[Optional[str], typer.Option(  # noqa: UP045 (typer)
        "--stage", help="Run this stage alone (the stages it reads must be complete); with --num-shards and "
        "--shard-index, one shard of it.", metavar="NAME")] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Check the whole pipeline (settings, templates against the columns each stage will read, "
        "SQL) and show its stages; run nothing.")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No progress display; errors are still printed.")]
    = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object on stdout.")] = False,
    *,
    overrides: dict[tuple[str, str], tuple[Any, str]],
):
    """Run a pipeline: stages that generate, score and filter (SQL), each resumable, like make."""
    from cbgen.pipelines import load_pipeline

    spec = load_pipeline(file)
    if stage is None and any(key[1] in ("num_shards", "shard_index") for key in overrides):
        raise CbgenError("--num-shards and --shard-index split one stage: give it with --stage NAME")
    if check:
        raise typer.Exit(_check(spec, Path(output_dir), file, as_json))
    from cbgen.pipelines.runner import PipelineRun

    console = Console(stderr=True, log_path=False)

    def say(message: str) -> None:
        if not quiet:
            console.print(message, markup=False, highlight=False)

    stop = threading.Event()
    with graceful_stop(stop, console):
        run = PipelineRun(spec, Path(output_dir), only=stage, extra=overrides, stop=stop, say=say,
                          progress=lambda _: make_progress(console, quiet))
        report = run.run()
    for note in report.notes:
        say(f"note: {note}")
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
    elif not quiet:
        console.print(_report_table(report, output_dir))
    if report.exit_code not in (ExitCode.OK, ExitCode.SOME_FAILED):
        console.print("stopped: run the same command again to resume", markup=False, highlight=False)
    raise typer.Exit(int(report.exit_code))


def _check(spec: Pipeline, output_dir: Path, file: str, as_json: bool) -> int:
    """--check: every stage planned (cbgen.pipelines.checks), shown with the columns of its table."""
    from cbgen.pipelines.checks import plan_pipeline

    plans = plan_pipeline(spec, output_dir)
    if as_json:
        typer.echo(json.dumps({"stages": [{"stage": p.stage.name, "kind": p.stage.kind,
                                           "reads": list(p.stage.upstream) or [p.stage.input],
                                           "columns": p.table.names} for p in plans.values()]}))
        return ExitCode.OK
    table = Table(title=f"cbgen pipeline {file}: checked", title_justify="left")
    for column in ("stage", "kind", "reads", "its table's columns"):
        table.add_column(column)
    for p in plans.values():
        table.add_row(p.stage.name, p.stage.kind, ", ".join(p.stage.upstream) or str(p.stage.input),
                      ", ".join(p.table.names))
    Console().print(table)
    return ExitCode.OK


def _report_table(report: PipelineReport, output_dir: str) -> Table:
    table = Table(title=f"cbgen pipeline: {output_dir}", title_justify="left")
    for column in ("stage", "kind", "state", "rows", "failed", "seconds"):
        table.add_column(column, justify="right" if column in ("rows", "failed", "seconds") else "left")
    for o in report.stages:
        table.add_row(o.name, o.kind, o.state, "" if o.rows is None else str(o.rows), str(o.failed),
                      f"{o.seconds:.1f}")
    return table
