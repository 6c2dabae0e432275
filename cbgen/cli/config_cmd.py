"""`cbgen config`: show the effective job configuration, or write a commented template."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from cbgen.cli._options import ConfigFile, job_options
from cbgen.config import build_config, config_template
from cbgen.errors import CbgenError

app = typer.Typer(help="Inspect and create job configuration files.", no_args_is_help=True)


@app.command("show")
@job_options
def show(config: ConfigFile = None, *, overrides: dict[tuple[str, str], tuple[Any, str]]):
    """Print the effective configuration (defaults < --config file < flags) as YAML.

    Example: cbgen config show --config job.yaml --page-size 64
    """
    typer.echo(build_config(config, overrides).to_yaml(), nl=False)


@app.command("init")
def init(
    path: Annotated[str, typer.Argument(help="Where to write the template.")] = "job.yaml",
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace an existing file.")] = False,
):
    """Write a commented job-file template with every option and its default."""
    target = Path(path)
    if target.exists() and not force:
        raise CbgenError(f"'{target}' already exists; pass --force to replace it")
    target.write_text(config_template(), encoding="utf-8")
    typer.echo(f"wrote {target}; edit it, then: cbgen run --config {target} PROMPTS.jsonl")


@app.command("reference")
def reference():
    """Print the reference of every job setting (each YAML key, its flag, what it takes, its default and what it
    means) as Markdown: the page docs/reference.md is this output.

    Example: cbgen config reference > docs/reference.md
    """
    from cbgen.cli.reference import reference_markdown

    typer.echo(reference_markdown(), nl=False)
