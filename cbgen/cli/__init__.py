"""The `cbgen` command line: the app wired here, one module per command, errors mapped to messages in one place."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

import typer
from typer.core import TyperGroup

from cbgen.errors import DEBUG_VARIABLE, CbgenError, ExitCode, debug_enabled, first_line
from cbgen.process.changes import Environ
from cbgen.process.startup import HUGE_PAGES, hold_gc

# cbgen shows its own progress; other libraries' bars (the GGUF dequantizer's) would break its display. tqdm reads
# this when it is imported, so a command sets it before anything imports tqdm, and puts it back when it returns (a
# program that imports cbgen.cli keeps its environment); TQDM_DISABLE=0 in the environment brings the bars back.
# HUGE_PAGES likewise (cbgen.process.startup says why); THP_MEM_ALLOC_ENABLE=0 keeps 4 KB pages.
COMMAND_ENVIRONMENT = {"TQDM_DISABLE": "1", **HUGE_PAGES}

HELP = ("Offline batch generation with LLMs on Hugging Face transformers' continuous batching.\n\n"
        "Give it a file of prompts; it answers every one and writes sharded outputs plus run.json.")
# Every command: the module that defines it, the name of its function (or typer app, for a group), and its line in
# `cbgen --help` (the first line of its docstring: tests/cli/test_help.py keeps the two the same). A command's module
# is imported only when the command runs or shows its own help, so `cbgen --help` imports none of them.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("cbgen.cli.run", "run", "Generate an answer for every prompt in INPUT with continuous batching."),
    "score": ("cbgen.cli.score_cmd", "score", "Score text with the model: completions after their prompts, choices, "
              "or texts on their own."),
    "embed": ("cbgen.cli.embed_cmd", "embed", "Embed text with an embedding model: one pooled vector per row."),
    "pipeline": ("cbgen.cli.pipeline_cmd", "pipeline", "Run a pipeline: stages that generate, score and filter "
                 "(SQL), each resumable, like make."),
    "status": ("cbgen.cli.collect_cmds", "status", "Report done / failed / remaining requests of a job, shard by "
               "shard."),
    "merge": ("cbgen.cli.collect_cmds", "merge", "Check that every input id is present exactly once across the shards "
              "of a split job, then merge them."),
    "bench": ("cbgen.cli.bench_cmd", "bench", "Measure cbgen's engine path against plain generate_batch and static "
              "batching (model.generate) on named workloads, in one process with the same model and "
              "ContinuousBatchingConfig; print a table and write DIR/bench.json and DIR/bench.png."),
    "config": ("cbgen.cli.config_cmd", "app", "Inspect and create job configuration files."),
    "cache": ("cbgen.cli.cache_cmd", "app", "Inspect, prune or clear the result cache (answers kept across runs)."),
    "eval": ("cbgen.cli.eval_cmd", "eval_command", "Evaluate with lm-evaluation-harness on cbgen's engine "
             "(lm_eval --model cbgen; needs the eval extra)."),
}
EPILOGS = {"run": ("cbgen.cli.run", "EPILOG"), "score": ("cbgen.cli.score_cmd", "EPILOG"),
           "embed": ("cbgen.cli.embed_cmd", "EPILOG"),
           "pipeline": ("cbgen.cli.pipeline_cmd", "EPILOG")}


def _literal(cmd: Any) -> None:
    """Every help text shown as written: typer reads help as Rich markup, where `[ids]` or `[default: 256]` would be
    taken for style tags and vanish. Only the epilogs use markup on purpose."""
    from rich.markup import escape

    if cmd.help:
        cmd.help = escape(cmd.help)
    for param in cmd.params:  # options, and typer's arguments, which carry a help text too
        if getattr(param, "help", None):
            param.help = escape(param.help)
    for sub in getattr(cmd, "commands", {}).values():
        _literal(sub)


def load_command(name: str, *, literal: bool = True) -> Any:
    """The click command `cbgen NAME` runs, built from its module (imported now); `literal`: its help texts escaped
    for display (see `_literal`), else as written in the source."""
    import importlib

    module, attribute, _ = COMMANDS[name]
    target = getattr(importlib.import_module(module), attribute)
    command: Any
    if isinstance(target, typer.Typer):
        command = typer.main.get_group(target)
    else:
        single = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")
        epilog = EPILOGS.get(name)
        single.command(name, epilog=getattr(importlib.import_module(epilog[0]), epilog[1]) if epilog else None,
                       context_settings=getattr(importlib.import_module(module), "CONTEXT", None))(target)
        command = typer.main.get_command(single)
    if literal:
        _literal(command)
    return command


class _Commands(TyperGroup):
    """The root command: its subcommands are loaded by name when one runs; `cbgen --help` lists them from COMMANDS
    without importing any."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._listing = False
        self._loaded: dict[str, Any] = {}

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, name: str) -> Any:
        if name not in COMMANDS:
            return None
        if self._listing and name not in self._loaded:
            import click

            return click.Command(name, help=COMMANDS[name][2])
        if name not in self._loaded:
            self._loaded[name] = load_command(name)
        return self._loaded[name]

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


def command() -> TyperGroup:
    """The app as a click command."""
    return _Commands(name="cbgen", help=HELP, no_args_is_help=True, rich_markup_mode="rich",
                     context_settings={"help_option_names": ["-h", "--help"]})


def run_cli(argv: list[str] | None = None) -> int:
    """Runs the CLI on `argv` and returns the exit code; every error becomes one line on stderr.

    Tracebacks are printed only when CBGEN_DEBUG=1.
    """
    debug = debug_enabled()
    try:
        with Environ(COMMAND_ENVIRONMENT, keep_set=True):
            command()(args=argv, prog_name="cbgen")  # standalone: usage errors are printed by click, exit code 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except CbgenError as e:
        if debug:
            traceback.print_exc()
        print(f"Error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - the one place that turns any crash into a message
        if debug:
            traceback.print_exc()
        message = f": {first_line(e)}" if str(e).strip() else ""
        print(f"Error: unexpected {type(e).__name__}{message} (set {DEBUG_VARIABLE}=1 to see the traceback)",
              file=sys.stderr)
        return ExitCode.INTERNAL
    return ExitCode.OK


def main() -> None:
    """The `cbgen` command. Exits without Python's slow teardown once everything is written (the job has written
    and flushed its files by then; only the interpreter's own clean-up of torch's objects is skipped), except under
    torchrun, whose process group is torn down at exit."""
    hold_gc()
    code = run_cli()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
