"""`cbgen run`: answer every prompt of a file with a model and write the results."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from cbgen.cli._options import ConfigFile, job_options
from cbgen.cli.progress import make_progress, summary_table
from cbgen.config import build_config
from cbgen.errors import ExitCode

EPILOG = """\
[bold]Examples[/bold]

  cbgen run prompts.jsonl --page-size 128                  [dim]# writes ./cbgen-out/[/dim]\n
  cbgen run prompts.parquet -o out/ --model Qwen/Qwen3-4B --config job.yaml --max-new-tokens 512 --logprobs\n
  cat prompts.jsonl | cbgen run - -o out/ --temperature 0.7 -n 4

[bold]Input rows[/bold] (JSONL or Parquet) carry one of: [cyan]prompt[/cyan] (text), [cyan]messages[/cyan] (chat turns,
rendered with the model's chat template) or [cyan]input_ids[/cyan] (token ids).

[bold]Output[/bold]: DIR/part-00000.jsonl ... (one row per returned sequence: id, sample_index, text, token_ids,
num_prompt_tokens, num_generated_tokens, finish_reason stop|length|error, error, [logprobs], kept columns) and
DIR/run.json (configuration, model, versions, counts, timings, throughput).

[bold]Exit codes[/bold]: 0 every request succeeded · 1 some requests failed (they are in the output with their error) ·
2 usage, configuration or input-file error (nothing generated) · 3 unexpected internal error (CBGEN_DEBUG=1 shows
the traceback) · 130 interrupted (Ctrl-C).
"""


@job_options
def run(
    input_path: Annotated[
        Optional[str],  # noqa: UP045 (typer)
        typer.Argument(metavar="INPUT", help="JSONL or Parquet file of prompts (or a folder of Parquet files); "
                       "- reads JSONL from stdin.", show_default=False),
    ] = None,
    config: ConfigFile = None,
    *,
    overrides: dict[tuple[str, str], tuple[Any, str]],
):
    """Generate an answer for every prompt in INPUT with continuous batching."""
    from cbgen.job import run_job  # imports torch and transformers: only once the arguments are known to be good

    if input_path is not None:
        overrides[("input", "path")] = (input_path, "INPUT")
    job = build_config(config, overrides)
    console = Console(stderr=True, log_path=False)
    try:
        summary = run_job(job, make_progress(console, job.run.quiet))
    except KeyboardInterrupt:
        console.print(f"Interrupted: complete shards are kept in {job.output.dir}", markup=False)
        raise typer.Exit(ExitCode.INTERRUPTED) from None
    if not job.run.quiet:
        console.print(summary_table(summary))
    raise typer.Exit(int(summary.exit_code))
