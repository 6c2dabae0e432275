"""`cbgen run`: answer every prompt of a file with a model and write the results."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from cbgen.cli._options import ConfigFile, InputPath, job_options
from cbgen.config import JobConfig, build_config
from cbgen.errors import CbgenError, ExitCode
from cbgen.kinds import DEFAULT
from cbgen.parallel.launch import RAY, launch_of

if TYPE_CHECKING:
    from cbgen.outputs.summary import RunSummary

EPILOG = (
    "[bold]Examples[/bold]\n\n"
    "  cbgen run prompts.jsonl --page-size 128   [dim]# writes ./cbgen-out/[/dim]\n\n"
    "  cbgen run prompts.parquet -o out/ --model Qwen/Qwen3-4B --config job.yaml --max-new-tokens 512 --logprobs\n\n"
    "  cat prompts.jsonl | cbgen run - -o out/ --temperature 0.7 -n 4\n\n"
    "  cbgen run batch_input.jsonl --output-format openai -o out/   [dim]# an OpenAI Batch API file, as is[/dim]\n\n"
    "  cbgen run my-dataset/ --split test --prompt-column question   [dim]# save_to_disk folder or hub id[/dim]\n\n"
    "[bold]Input rows[/bold] (JSONL, Parquet, datasets) carry one of: prompt (text), messages (chat turns, rendered "
    "with the model's chat template) or input_ids (token ids); and, if they like, their own temperature, top_p, "
    "top_k, max_new_tokens and stop. OpenAI batch lines carry body.messages or body.prompt.\n\n"
    "[bold]Output[/bold]: DIR/part-00000.jsonl ... with one row per returned sequence (id, sample_index, text, "
    "token_ids, num_prompt_tokens, num_generated_tokens, finish_reason stop|length|error, error, \\[logprobs], kept "
    "columns), or one OpenAI batch output line per request (--output-format openai); and DIR/run.json "
    "(configuration, model, versions, counts, timings, throughput).\n\n"
    "[bold]Resuming[/bold]: run the same command again on the same output directory; finished requests are never "
    "generated again. A directory holding a different job (model, input or generation settings) is refused unless "
    "--overwrite.\n\n"
    "[bold]Exit codes[/bold]: 0 every request succeeded · 1 some requests failed (they are in the output with their "
    "error) · 2 usage, configuration or input-file error (nothing generated) · 3 unexpected internal error "
    "(CBGEN_DEBUG=1 shows the traceback) · 4 stopped after more than --max-errors failures · 75 stopped by SIGTERM or "
    "Ctrl-C · 130 stopped at once by a second Ctrl-C. After 4, 75 and 130 the job resumes when run again."
)


@job_options
def run(
    input_path: InputPath = None,
    config: ConfigFile = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Generate nothing: read and render every row with the tokenizer only (no model weights) "
        "and report the rows, the error records the job would write, its prompt tokens and the KV cache it would "
        "reserve.", rich_help_panel="Run")] = False,
    estimate_time: Annotated[bool, typer.Option(
        "--estimate-time", help="With --dry-run: also time a short sample of the requests on the real model and "
        "estimate the generation time (it says how).", rich_help_panel="Run")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="With --dry-run: print the report as one JSON object on stdout, for scripts.",
        rich_help_panel="Run")] = False,
    *,
    overrides: dict[tuple[str, str], tuple[Any, str]],
):
    """Generate an answer for every prompt in INPUT with continuous batching."""
    job = job_of(input_path, config, overrides)
    if (estimate_time or as_json) and not dry_run:
        raise CbgenError("--estimate-time and --json go with --dry-run")
    if dry_run:
        raise typer.Exit(_dry_run(job, estimate_time, as_json))
    if launch_of(job, "cbgen run") == RAY:
        from cbgen.executors.ray import run_on_ray

        console = Console(stderr=True, log_path=False)
        raise typer.Exit(run_on_ray(job, lambda line: console.log(line, markup=False, highlight=False)))
    from cbgen.job.follow import follow_job
    from cbgen.parallel.tensor import setup

    tp = setup(job)  # None unless started by torchrun with --tp
    if tp is not None and not tp.driver:
        try:
            raise typer.Exit(follow_job(job, tp))  # rank 0 reads, writes and reports; this rank runs its model shard
        finally:
            tp.close()
    run_reported(job, tp)


def job_command(input_path: str | None, config: str | None, overrides: dict[tuple[str, str], tuple[Any, str]],
                kind: str, command: str) -> None:
    """The body of a command that runs one job of `kind` in this process (cbgen score, cbgen embed): the job from
    its file and flags, where it runs checked (cbgen.parallel.launch), run, reported."""
    job = job_of(input_path, config, overrides, kind)
    launch_of(job, command)
    run_reported(job)


def job_of(input_path: str | None, config: str | None, overrides: dict[tuple[str, str], tuple[Any, str]],
           kind: str = DEFAULT) -> JobConfig:
    """The job a command's INPUT, --config file and flags make."""
    if input_path is not None:
        overrides[("input", "path")] = (input_path, "INPUT")
    return build_config(config, overrides, kind=kind)


def run_reported(job: JobConfig, tp: Any = None) -> None:
    """Runs `job` here (rank 0 under `tp`), stopping gracefully on SIGTERM or Ctrl-C, and ends the command with its
    report and exit code."""
    from cbgen.cli.display import make_progress  # the display's imports are not paid by `cbgen run --help`
    from cbgen.job.run import run_job  # imports torch and transformers: only once the arguments are known to be good

    console = Console(stderr=True, log_path=False)
    stop = threading.Event()
    try:
        with graceful_stop(stop, console):
            summary = run_job(job, make_progress(console, job.run.quiet), stop, tp)
    finally:
        if tp is not None:
            tp.close()
    report(console, job, summary)


def report(console: Console, job: JobConfig, summary: RunSummary) -> None:
    """The end of a job's command: its summary table (unless --quiet), how to resume a stopped job, its exit code."""
    from cbgen.cli.display import summary_table

    if not job.run.quiet:
        console.print(summary_table(summary))
    if summary.exit_code not in (ExitCode.OK, ExitCode.SOME_FAILED):
        console.print(f"{summary.status}: complete results are in {summary.output_dir}; run the same command again "
                      "to resume", markup=False, highlight=False)
    raise typer.Exit(int(summary.exit_code))


def _dry_run(job: JobConfig, estimate: bool, as_json: bool) -> int:
    from cbgen.job.dry_run import dry_run

    report = dry_run(job, estimate)
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
        return ExitCode.OK
    from cbgen.cli.display import dry_run_table

    Console().print(dry_run_table(report))
    return ExitCode.OK


@contextmanager
def graceful_stop(stop: threading.Event, console: Console) -> Iterator[None]:
    """SIGTERM (Slurm preemption, `kill`) and the first Ctrl-C set `stop`: the job admits nothing more, writes what
    has finished and exits resumable. A second Ctrl-C exits at once; the committed shards still allow a resume."""

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            os._exit(ExitCode.INTERRUPTED)
        stop.set()
        name = signal.Signals(signum).name
        console.print(f"{name} received: stopping; finished results are being written, then the job exits "
                      "resumable (Ctrl-C again to stop at once)", markup=False, highlight=False)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
