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
    --output_path, ...) are its own: `cbgen eval --help`. `--adapter PATH` evaluates the model with a LoRA adapter
    merged (model arg `adapter`; docs/adapters.md). Install: pip install 'cbgen[eval]'. Docs: docs/evaluation.md."""
    from cbgen.evaluation import register

    register()
    from lm_eval.__main__ import cli_evaluate

    args = with_adapter(list(ctx.args))
    named = any(arg == "--model" or arg.startswith("--model=") for arg in args)
    if not args or args in (["-h"], ["--help"]):
        print("\n\n".join(" ".join(part.split()) for part in (eval_command.__doc__ or "").split("\n\n"))
              + "\n\nlm-eval's options:\n")
        args = ["run", "--help"]
    elif not named:
        args = ["--model", "cbgen", *args]
    sys.argv = ["cbgen eval", *args]
    cli_evaluate()


def with_adapter(args: list[str]) -> list[str]:
    """lm-eval's arguments with cbgen's `--adapter PATH` (or `--adapter=PATH`) moved into `--model_args`, as the model
    arg `adapter` (lm-eval has no such option of its own)."""
    adapters, rest = [], []
    items = iter(args)
    for arg in items:
        if arg == "--adapter":
            adapters.append(next(items, ""))
        elif arg.startswith("--adapter="):
            adapters.append(arg.removeprefix("--adapter="))
        else:
            rest.append(arg)
    if not adapters:
        return args
    extra = ",".join(f"adapter={a}" for a in adapters)
    for i, arg in enumerate(rest):
        if arg == "--model_args" and i + 1 < len(rest):
            rest[i + 1] = f"{rest[i + 1]},{extra}" if rest[i + 1] else extra
            return rest
        if arg.startswith("--model_args="):
            rest[i] = f"{arg},{extra}"
            return rest
    return [*rest, "--model_args", extra]
