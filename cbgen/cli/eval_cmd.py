"""`cbgen eval`: lm-evaluation-harness's own command line, with cbgen registered as its model `cbgen`."""

from __future__ import annotations

import sys

import typer

# every argument goes to lm-eval as it is, --help included (lm-eval's help lists them)
CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def eval_command(ctx: typer.Context) -> None:
    """Evaluate with lm-evaluation-harness on cbgen's engine (lm_eval --model cbgen; needs the eval extra).

    `cbgen eval --model_args model=M,dtype=float32 --tasks T --include_path DIR` is `lm_eval --model cbgen ...`
    (--model cbgen unless another is named, so `--model hf` runs lm-eval's own backend for comparison). Model args
    are cbgen settings by their YAML names; lm-eval's options (--tasks, --limit, --use_cache, --apply_chat_template,
    --output_path, ...) are its own: `cbgen eval --help`. Install: pip install 'cbgen[eval]'. Docs:
    docs/evaluation.md."""
    from cbgen.evaluation import register

    register()
    from lm_eval.__main__ import cli_evaluate

    args = list(ctx.args)
    named = any(arg == "--model" or arg.startswith("--model=") for arg in args)
    if not args or args in (["-h"], ["--help"]):
        print("\n\n".join(" ".join(part.split()) for part in (eval_command.__doc__ or "").split("\n\n"))
              + "\n\nlm-eval's options:\n")
        args = ["run", "--help"]
    elif not named:
        args = ["--model", "cbgen", *args]
    sys.argv = ["cbgen eval", *args]
    cli_evaluate()
