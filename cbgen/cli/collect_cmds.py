"""`cbgen status` and `cbgen merge`: how far a job is, and one result from the shards of a split job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from cbgen.errors import ExitCode
from cbgen.kinds import kind_of

InputOverride = Annotated[
    Optional[str],  # noqa: UP045 (typer)
    typer.Option("--input", help="The job's input file, if it has moved since the run (or was read from stdin).",
                 metavar="FILE"),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead, for scripts.")]

_STATE_WORDS = {"incomplete": "incomplete: run it again to resume"}


def status(
    directory: Annotated[str, typer.Argument(help="The job's output directory (-o of cbgen run), or a pipeline's.")],
    input_path: InputOverride = None,
    as_json: AsJson = False,
):
    """Report done / failed / remaining requests of a job, shard by shard.

    Exit code 0 when every request is done, 1 when some are not (or failed), 2 for a directory that holds no job.
    With --json: {"directory", "complete", "done", "failed", "remaining", "columns", "directories": [{"directory",
    "shard", "done", "failed", "remaining", "state", "columns", "cache"}, ...]}; remaining is null when the input
    cannot be read, columns (the rows' columns) until a run has planned, and cache ({"hits", "near_hits", "misses",
    "not_cached"}: the requests of its last run the result cache answered, or not) when that run used no cache.

    On a pipeline's directory (-o of cbgen pipeline), one row per stage: {"directory", "complete", "stages":
    [{"stage", "kind", "state", "done", "failed", "remaining", "rows"}, ...]} with --json (rows: an sql stage's).

    Example: cbgen status out/ --json | jq .remaining
    """
    from cbgen.outputs.collect import job_status
    from cbgen.pipelines.status import is_pipeline_directory

    if is_pipeline_directory(Path(directory)):
        raise typer.Exit(_pipeline_status(Path(directory), as_json))
    rows = job_status(Path(directory), input_path)
    remaining = [r.remaining for r in rows]
    total_remaining = None if any(r is None for r in remaining) else sum(r or 0 for r in remaining)
    incomplete = any(r.remaining != 0 or r.failed for r in rows)
    columns = next((r.columns for r in rows if r.columns is not None), None)
    if as_json:
        typer.echo(json.dumps({"directory": directory, "complete": not incomplete, "done": sum(r.done for r in rows),
                               "failed": sum(r.failed for r in rows), "remaining": total_remaining,
                               "columns": list(columns) if columns is not None else None,
                               "directories": [r.to_dict() for r in rows]}))
        raise typer.Exit(ExitCode.SOME_FAILED if incomplete else ExitCode.OK)
    table = Table(title=f"cbgen status: {directory}", title_justify="left")
    for column in ("directory", "done", "failed", "remaining", "state", "from cache (last run)"):
        table.add_column(column, justify="left" if column in ("directory", "state") else "right")
    for row in rows:
        table.add_row(row.path.name if row.shard else str(row.path), str(row.done), str(row.failed),
                      "?" if row.remaining is None else str(row.remaining), _STATE_WORDS.get(row.state, row.state),
                      row.from_cache)
    if len(rows) > 1:
        table.add_row("total", str(sum(r.done for r in rows)), str(sum(r.failed for r in rows)),
                      "?" if total_remaining is None else str(total_remaining), "", "", style="bold")
    Console().print(table)
    if columns is not None:
        typer.echo(f"columns: {', '.join(columns)}")
    raise typer.Exit(ExitCode.SOME_FAILED if incomplete else ExitCode.OK)


def merge(
    directory: Annotated[str, typer.Argument(help="The output directory of a job run with --num-shards or as a "
                                             "Slurm array (it holds shard-IIIII-of-NNNNN directories).")],
    output: Annotated[Optional[str], typer.Option("--output-dir", "-o", help="Where to write the merged shards. "  # noqa: UP045
                                                  "[default: DIRECTORY/merged]", metavar="DIR")] = None,
    input_path: InputOverride = None,
    to_dataset: Annotated[bool, typer.Option("--to-dataset", help="Write a Hugging Face dataset (open it with "
                                             "datasets.load_from_disk) instead of shards; also works on a job that "
                                             "was not split.")] = False,
    as_json: AsJson = False,
):
    """Check that every input id is present exactly once across the shards of a split job, then merge them.

    Nothing is written when ids are missing or repeated; the message says which, and which shard to rerun.
    Exit code 0 when merged, 1 when the shards are incomplete, 2 for a usage error. With --json: {"merged", "output",
    "rows", "missing": {shard: [ids]}, "duplicated", "unexpected", "shards_not_started"}.

    Example: cbgen merge out/ -o merged/ --json
    """
    from cbgen.outputs.collect import merge_shards

    report = merge_shards(Path(directory), Path(output) if output else None, input_path, to_dataset=to_dataset)
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
        raise typer.Exit(ExitCode.OK if report.complete else ExitCode.SOME_FAILED)
    console = Console(stderr=True)
    if report.complete:
        if to_dataset:
            typer.echo(f"merged {report.rows} rows into the dataset {report.output} (datasets.load_from_disk)")
        else:
            typer.echo(f"merged {report.rows} rows into {report.output}")
        raise typer.Exit(ExitCode.OK)
    for shard, ids in sorted(report.missing.items()):
        shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
        not_started = " (it never started)" if shard in report.shards_not_started else ""
        console.print(f"shard {shard}{not_started}: {len(ids)} ids missing: {shown}; rerun it with --shard-index "
                      f"{shard} (Slurm: --array={shard}) to finish it", markup=False, highlight=False)
    if report.duplicated:
        console.print(f"{len(report.duplicated)} ids appear more than once: {', '.join(report.duplicated[:10])}",
                      markup=False, highlight=False)
    if report.unexpected:
        console.print(f"{len(report.unexpected)} ids are not in the input: {', '.join(report.unexpected[:10])}",
                      markup=False, highlight=False)
    console.print("nothing was merged", markup=False)
    raise typer.Exit(ExitCode.SOME_FAILED)


def _pipeline_status(directory: Path, as_json: bool) -> int:
    """Each stage's progress; exit code 0 when every stage is complete without failed rows, else 1."""
    from cbgen.pipelines.status import pipeline_status

    stages = pipeline_status(directory)
    incomplete = any(s.state != "complete" or s.failed for s in stages)
    if as_json:
        typer.echo(json.dumps({"directory": str(directory), "complete": not incomplete,
                               "stages": [s.to_dict() for s in stages]}))
        return ExitCode.SOME_FAILED if incomplete else ExitCode.OK
    table = Table(title=f"cbgen status: pipeline {directory}", title_justify="left")
    for column in ("stage", "kind", "done", "failed", "remaining", "rows", "state"):
        table.add_column(column, justify="left" if column in ("stage", "kind", "state") else "right")
    for s in stages:
        table.add_row(s.name, s.kind, "" if s.done is None else str(s.done), str(s.failed),
                      "" if not kind_of(s.kind).over_rows else "?" if s.remaining is None else str(s.remaining),
                      "" if s.rows is None else str(s.rows), _STATE_WORDS.get(s.state, s.state))
    Console().print(table)
    return ExitCode.SOME_FAILED if incomplete else ExitCode.OK
