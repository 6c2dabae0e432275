"""The `cbgen` command line: the app wired here, one module per command, errors mapped to messages in one place."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

# cbgen shows its own progress; other libraries' bars (the GGUF dequantizer's) would break its display. tqdm reads
# this when it is imported, so it is set before anything imports it; TQDM_DISABLE=0 in the environment brings them back.
os.environ.setdefault("TQDM_DISABLE", "1")

import typer  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

from cbgen.cli import bench_cmd, collect_cmds, config_cmd, pipeline_cmd, run, score_cmd  # noqa: E402
from cbgen.errors import DEBUG_VARIABLE, CbgenError, ExitCode, debug_enabled, first_line  # noqa: E402
from cbgen.startup import hold_gc  # noqa: E402

app = typer.Typer(
    name="cbgen",
    help="Offline batch generation with LLMs on Hugging Face transformers' continuous batching.\n\n"
    "Give it a file of prompts; it answers every one and writes sharded outputs plus run.json.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("run", epilog=run.EPILOG)(run.run)
app.command("score", epilog=score_cmd.EPILOG)(score_cmd.score)
app.command("pipeline", epilog=pipeline_cmd.EPILOG)(pipeline_cmd.pipeline)
app.command("status")(collect_cmds.status)
app.command("merge")(collect_cmds.merge)
app.command("bench")(bench_cmd.bench)
app.add_typer(config_cmd.app, name="config")


def command() -> TyperGroup:
    """The app as a click command, with every help text shown as written: typer reads help as Rich markup, where
    `[ids]` or `[default: 256]` would be taken for style tags and vanish. Only the epilogs use markup on purpose."""
    from rich.markup import escape

    def literal(cmd: Any) -> None:
        if cmd.help:
            cmd.help = escape(cmd.help)
        for param in cmd.params:  # options, and typer's arguments, which carry a help text too
            if getattr(param, "help", None):
                param.help = escape(param.help)
        for sub in getattr(cmd, "commands", {}).values():
            literal(sub)

    root = typer.main.get_group(app)
    literal(root)
    return root


def run_cli(argv: list[str] | None = None) -> int:
    """Runs the CLI on `argv` and returns the exit code; every error becomes one line on stderr.

    Tracebacks are printed only when CBGEN_DEBUG=1.
    """
    debug = debug_enabled()
    try:
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
