"""`cbgen bench`: cbgen's engine path against `generate_batch`, static batching and llama.cpp, side by side."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from cbgen.bench.registry import BENCH_PATHS
from cbgen.errors import CbgenError

if TYPE_CHECKING:
    from cbgen.process.changes import Change

PATHS = tuple(BENCH_PATHS)


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def bench(
    model: Annotated[Optional[str], typer.Option("--model", "-m", metavar="MODEL",  # noqa: UP045
                                                 help="As for cbgen run. Default: the embedded SmolLM2.")] = None,
    dtype: Annotated[str, typer.Option(help="auto | bfloat16 | float16 | float32")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    attn_implementation: Annotated[Optional[str], typer.Option(metavar="NAME", help="As for cbgen run.")] = None,  # noqa: UP045
    size: Annotated[str, typer.Option(help="tiny | small | medium: requests per workload.")] = "small",
    workloads: Annotated[str, typer.Option(help="Comma-separated workloads, from: mixed, shared-prefix, long-prompt, "
                                           "many-small, structured (cbgen with and without a JSON schema), fixed "
                                           "(128-token prompts, 64 new tokens: llama-batched-bench's shape), sampling "
                                           "(cbgen greedy against sampled and seeded, per token), scoring "
                                           "(cbgen score's scorer as the cbgen path, against the model's forward "
                                           "over padded batches as the static path).")] = (
        "mixed,shared-prefix,long-prompt,many-small"
    ),
    paths: Annotated[str, typer.Option(help=f"Comma-separated paths, from: {', '.join(PATHS)}. cbgen-invariant, "
                                       "cbgen-variant (--no-batch-invariant), cbgen-eager (--no-compiled-attention "
                                       "--no-batch-invariant) and cbgen-onednn are the cbgen path with that setting, "
                                       "on the same loaded model.")]
    = "cbgen,generate_batch,static",
    static_batch_sizes: Annotated[str, typer.Option(help="Batch sizes for the static path.")] = "8,16,32",
    max_batch_tokens: Annotated[Optional[int], typer.Option(help="As for cbgen run.")] = None,  # noqa: UP045
    max_requests_per_batch: Annotated[Optional[int], typer.Option(help="As for cbgen run.")] = None,  # noqa: UP045
    page_size: Annotated[Optional[int], typer.Option(help="As for cbgen run.")] = None,  # noqa: UP045
    onednn_linear: Annotated[bool, typer.Option(
        "--onednn-linear/--stock-linear", help="As for cbgen run: float32 or bfloat16 linear layers through oneDNN "
        "with prepacked weights, on every path (the cbgen-onednn path measures it beside the stock layers).")]
    = False,
    llamacpp_model: Annotated[Optional[str], typer.Option(  # noqa: UP045
        metavar="GGUF", help="The GGUF file the llamacpp path runs. Default, for the embedded model: its f32 (or bf16, "
        "as --dtype) conversion made by benchmarks/build_llamacpp.sh.")] = None,
    llamacpp_q8_model: Annotated[Optional[str], typer.Option(  # noqa: UP045
        metavar="GGUF", help="The GGUF file the llamacpp-q8_0 path runs (llama.cpp on 8-bit weights: what its users "
        "pick on a CPU). Default, for the embedded model: its Q8_0 conversion made by "
        "benchmarks/build_llamacpp.sh.")] = None,
    llamacpp_parallel: Annotated[int, typer.Option(min=1, max=256, help="Sequences llama.cpp keeps in flight.")] = 64,
    output_dir: Annotated[str, typer.Option("--output-dir", "-o", metavar="DIR",
                                            help="Where bench.json and bench.png go.")] = "cbgen-bench",
    suite: Annotated[bool, typer.Option(
        "--suite", help="Run every headline comparison side by side instead (against generate_batch and llama.cpp, "
        "batch invariance's cost, sampling and the history controls, embeddings against sentence-transformers, "
        "dedup, warm start, --help), each against its goal, on the embedded models: one table, bench.json, "
        "bench.png. About an hour on 2 cores (the 1B section included); --quick under 5 minutes. The options above "
        "but --model, --size and -o do not apply.", rich_help_panel="Suite")] = False,
    quick: Annotated[bool, typer.Option(help="With --suite: every comparison, smaller and once, under 5 minutes "
                                        "on 2 cores (the fixed workload 16 x (128 + 32), sampling 16 x 64, 1B 4 x "
                                        "(64 + 16); batch invariance in the machine's dtype only, whole embedding "
                                        "commands and stock layers at 1B left to the full run).",
                                        rich_help_panel="Suite")] = False,
    allow_busy: Annotated[bool, typer.Option(
        "--allow-busy", help="With --suite: measure even when other processes use the cores (refused otherwise, "
        "exit code 75); a run timed under load is left out of its figure, which is void where a path has no "
        "quiet run.", rich_help_panel="Suite")] = False,
    check: Annotated[bool, typer.Option(help="With --suite: exit with code 1 when a goal that applies here is "
                                        "missed, void or not measured.", rich_help_panel="Suite")] = False,
    allow_missing: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        "--allow-missing", metavar="NAME", help="With --suite --check: comparisons that may go unmeasured without "
        "failing the check: those whose name (the table's, up to its first comma) starts with NAME, e.g. 'cbgen vs "
        "llama.cpp'; repeatable.", rich_help_panel="Suite")] = None,
    sections: Annotated[Optional[str], typer.Option(  # noqa: UP045
        metavar="NAMES", help="With --suite: only these sections, comma-separated, from: generation, scale, "
        "invariance, sampling, embedding, dedup, start.", rich_help_panel="Suite")] = None,
    hold: Annotated[Optional[str], typer.Option(  # noqa: UP045
        metavar="KIND", help="With --suite: run it held to a smaller CPU kind's instructions (avx512-bf16, avx512, "
        "avx2: torch, oneDNN, MKL and cbgen's own choices), to time that kind's paths on this machine. The "
        "figures say they were held; llama.cpp is not held, so no goal is read from its rows.",
        rich_help_panel="Suite")] = None,
    embed_model: Annotated[Optional[str], typer.Option(  # noqa: UP045
        metavar="MODEL", help="With --suite: the embedding model (default: the embedded all-MiniLM-L6-v2).",
        rich_help_panel="Suite")] = None,
):
    """Measure cbgen's engine path against plain generate_batch and static batching (model.generate) on named
    workloads, in one process with the same model and ContinuousBatchingConfig; print a table and write
    DIR/bench.json and DIR/bench.png.

    The llamacpp path runs the same token ids through llama.cpp (built by benchmarks/build_llamacpp.sh) on the
    same weights in the same precision, llamacpp-q8_0 on its 8-bit quantization (each with the share of greedy
    answers equal to cbgen's); each is skipped, with the reason, when llama.cpp or the GGUF file is missing.

    Example: cbgen bench --size small --paths cbgen,cbgen-ordered,generate_batch,static

    Example: cbgen bench --workloads fixed --paths cbgen,llamacpp

    Example: cbgen bench --workloads fixed,mixed --paths cbgen,cbgen-variant,cbgen-eager

    Example: cbgen bench --workloads scoring --paths cbgen,static --static-batch-sizes 8,16

    Example: cbgen bench --suite --quick

    Example: cbgen bench --suite --hold avx512-bf16 -o held/
    """
    if suite:
        return _suite(quick, size, model, embed_model, allow_busy, check, sections, hold, Path(output_dir),
                      tuple(allow_missing or ()))
    from cbgen.bench import (
        Bench,
        build_workloads,
        matmul_flops,
        meta_for,
        parameter_count,
        run_suite,
        summarise,
        write_outputs,
    )
    from cbgen.config import ModelSection, check_value
    from cbgen.model import dtype_name
    from cbgen.model.load import load_model

    chosen_paths = _checked_paths(paths, size)
    batching = {key: check_value("batching", key, value, f"--{key.replace('_', '-')}")
                for key, value in (("max_batch_tokens", max_batch_tokens), ("page_size", page_size),
                                   ("max_requests_per_batch", max_requests_per_batch)) if value is not None}
    console = Console(stderr=True, log_path=False)
    settings = ModelSection(model=model, dtype=check_value("model", "dtype", dtype, "--dtype"),
                            device=check_value("model", "device", device, "--device"),
                            attn_implementation=attn_implementation, onednn_linear=onednn_linear)
    console.log("loading the model")
    loaded = load_model(settings)
    try:
        chosen = build_workloads(loaded.tokenizer, size, _split(workloads))
    except ValueError as e:
        raise CbgenError(f"--workloads: {e}") from None
    gguf, quantized, reasons = None, None, {}  # why a chosen path cannot run here, or None
    if "llamacpp" in chosen_paths:
        gguf, reasons["llamacpp"] = _llamacpp_ready(llamacpp_model, loaded)
    if "llamacpp-q8_0" in chosen_paths:
        quantized, reasons["llamacpp-q8_0"] = _llamacpp_ready(llamacpp_q8_model, loaded, quantized=True)
    if "cbgen-onednn" in chosen_paths:
        reasons["cbgen-onednn"] = _onednn_unready(loaded, settings)
    skipped = {path: reason for path, reason in reasons.items() if reason}
    for path, reason in skipped.items():
        chosen_paths.remove(path)
        console.print(f"{path} path skipped: {reason}", markup=False)
    console.log(f"measuring the machine's {dtype_name(loaded.dtype)} matmul rate")
    peak = matmul_flops(loaded.dtype, device=loaded.model.device)
    flops_per_token = 2 * parameter_count(loaded.model)

    def show(m) -> None:
        console.log(f"{m.workload:<14} {m.path:<18} {m.seconds:7.2f} s  {m.total_tokens_per_s:8.1f} tok/s")

    results = run_suite(loaded, chosen, chosen_paths, [int(b) for b in _split(static_batch_sizes)], batching, show,
                        llamacpp_model=gguf, llamacpp_parallel=llamacpp_parallel, model=settings,
                        llamacpp_quantized=quantized)
    rows = summarise(results, flops_per_token, peak)
    scope = Bench(loaded, batching, settings).scope().describe()
    meta = meta_for(loaded, size, peak, batching, scope) | ({"skipped": skipped} if skipped else {})
    if gguf is not None:
        meta["llamacpp_model"] = str(gguf)
    if quantized is not None:
        meta["llamacpp_q8_0_model"] = str(quantized)
    json_path, png_path = write_outputs(rows, meta, Path(output_dir))
    _print_table(rows, meta, size)
    console.print(f"{meta['matmul_dtype']} matmul rate {peak / 1e9:.0f} GFLOP/s; wrote {json_path} and {png_path}",
                  markup=False)


def _suite(quick: bool, size: str, model: str | None, embed_model: str | None, allow_busy: bool, check: bool,
           sections: str | None, hold: str | None, output_dir: Path, allow_missing: tuple[str, ...] = ()) -> None:
    from cbgen.config.cpu import HOLDS

    if hold is not None:
        if hold not in HOLDS:
            raise CbgenError(f"--hold: not a smaller CPU kind; use one of {', '.join(HOLDS)}")
        from cbgen.config.cpu import unholdable_reason

        if (reason := unholdable_reason(hold)) is not None:
            raise CbgenError(f"--hold {hold}: {reason}")
        import os
        import subprocess
        import sys

        code = subprocess.run([sys.executable, "-m", "cbgen", *without_hold(sys.argv[1:])],
                              env=os.environ | HOLDS[hold]).returncode
        raise typer.Exit(code)
    with _no_gpus():
        from cbgen.bench.report import print_suite, write_suite
        from cbgen.bench.sections import SECTIONS
        from cbgen.bench.suite import Plan
        from cbgen.bench.suite_runner import run

        only = tuple(_split(sections or ""))
        unknown = [name for name in only if name not in SECTIONS]
        if unknown:
            raise CbgenError(f"--sections: unknown section '{unknown[0]}'; choose from: {', '.join(SECTIONS)}")
        _checked_paths("cbgen", size)
        console = Console(stderr=True, log_path=False)
        rows, meta = run(Plan.of(quick, size), model, embed_model, allow_busy,
                         lambda line: console.log(line, markup=False), only)
        json_path, png_path = write_suite(rows, meta, output_dir)
        print_suite(rows, meta)
        console.print(f"wrote {json_path} and {png_path}", markup=False)
        if check:
            _check(rows, allow_missing, console)


def _check(rows, allow_missing: tuple[str, ...], console: Console) -> None:
    """--check: exits 1 naming each goal missed, void, or not measured (unless --allow-missing names it)."""
    from cbgen.bench.tables import comparison

    failing = [row for row in rows if row.standing in ("missed", "void", "not measured")
               and not (row.standing == "not measured"
                        and any(comparison(row.name).startswith(name) for name in allow_missing))]
    for row in failing:
        console.print(f"check: {row.name}: {row.standing}" + (f" ({row.note})" if row.note else ""), markup=False)
    if failing:
        raise typer.Exit(1)


def without_hold(argv: list[str]) -> list[str]:
    """The command line without its --hold option and that option's own argument (and nothing else: `--hold avx2 -o
    avx2` keeps its output folder)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--hold":
            skip = True
        elif not arg.startswith("--hold="):
            kept.append(arg)
    return kept


def _no_gpus() -> Change:
    """The suite measures the CPU (its goals are against CPU peers): every model it loads, here and in the commands
    it starts, runs there, on a GPU machine too (benchmarks/gpu_check.py is the GPU's check). CUDA_VISIBLE_DEVICES
    is emptied before torch is imported, so CUDA never starts in this process, and put back when the suite ends."""
    from cbgen.process.changes import Environ

    return Environ({"CUDA_VISIBLE_DEVICES": ""})


def _llamacpp_ready(explicit: str | None, loaded, quantized: bool = False):
    """(the GGUF file for the llamacpp path, or the llamacpp-q8_0 path's, None) or (None, why the path is skipped)."""
    from cbgen.bench.llamacpp import QUANTIZED, bindings, find_gguf
    from cbgen.model import dtype_name
    from cbgen.model.source import EMBEDDED_NAME

    gguf, reason = find_gguf(explicit, loaded.source.name == EMBEDDED_NAME,
                             QUANTIZED if quantized else dtype_name(loaded.dtype))
    if gguf is None:
        return None, reason
    if loaded.device != "cpu":
        return None, "cbgen's llama.cpp build is for the CPU; run it with --device cpu"
    _, reason = bindings()
    return (None, reason) if reason else (gguf, None)


def _onednn_unready(loaded, settings) -> str | None:
    """Why the cbgen-onednn path cannot run on this model and machine, or None."""
    from cbgen.model.linear import PACKED_DTYPES, onednn_unfit

    if loaded.device != "cpu" or loaded.dtype not in PACKED_DTYPES:
        return "oneDNN's linear layers are for float32 or bfloat16 on CPU: add --device cpu"
    unfit = onednn_unfit(loaded.dtype)
    if unfit is not None:
        return unfit
    if settings.onednn_linear:
        return "--onednn-linear already runs every cbgen path through oneDNN"
    return None


def _checked_paths(paths: str, size: str) -> list[str]:
    chosen = _split(paths)
    unknown = [p for p in chosen if p not in PATHS]
    if unknown:
        raise CbgenError(f"--paths: unknown path '{unknown[0]}'; choose from: {', '.join(PATHS)}")
    if size not in ("tiny", "small", "medium"):
        raise CbgenError(f"--size must be one of: tiny, small, medium (got {size!r})")
    return chosen


def _print_table(rows: list[dict], meta: dict, size: str) -> None:
    table = Table(title=f"cbgen bench: {meta['model']}, {meta['dtype']}, {meta['device']}, size {size}",
                  title_justify="left")
    columns = ["workload", "path", "seconds", "prompt_tok_s", "generated_tok_s", "total_tok_s", "time_vs_cbgen",
               "token_time_vs_cbgen", "mfu"]
    for column in columns:
        table.add_column(column.replace("_", " "), justify="left" if column in ("workload", "path") else "right")
    for row in rows:
        table.add_row(*[("" if row[c] is None else f"{row[c]:.1%}" if c == "mfu" else str(row[c])) for c in columns])
    out = Console()
    if not out.is_terminal:
        out.width = 160  # a log file: do not wrap the table at 80 columns
    out.print(table)
