"""The suite's scale section: cbgen against llama.cpp at the sizes people run, on the same weights.

A shape of a real model (cbgen's random-weight shapes: Llama-3.2-1B's config, and in the full run Qwen3-4B's where
the machine's memory holds it) gets random weights made here, seeded (cbgen's own random loader), saved once as a
model folder and converted once by llama.cpp's own script (convert_hf_to_gguf.py, from the build of
benchmarks/build_llamacpp.sh) to GGUF files in the model's precision and in Q8_0, all kept in llama.cpp's models
folder. The model's precision is what `--dtype auto` picks on this CPU kind (`precision`): float32 (f32 files) on
AVX2, bfloat16 (bf16 files) where the CPU has bfloat16 units. The fixed workload (full: 16 x (128 + 64), --quick:
4 x (64 + 16)) then runs through its paths, alternately round after round (the full run: two rounds, so that
one disturbed minute of the machine does not decide a goal; --quick: one, as its runs take minutes at this size on a
2-core CPU):

    cbgen float32|bfloat16   the folder, as `cbgen run --model DIR` runs it (and, in the full run, with stock linear
                             layers, --no-batch-invariant: what batch invariance costs at this size)
    cbgen int8               the Q8_0 file, as `cbgen run --model FILE` runs it: its int8 values read as they are
                             (embeddings and output layer too), through cbgen's compiled int8 kernel
    cbgen w8a8               the Q8_0 file with `--quantize w8a8` (int8 rows too, integer products: other answers),
                             where the CPU has AVX-512 VNNI; its rows carry no goal (the issue's int8 is the one above)
    llama.cpp f32|bf16       the file in the model's precision
    llama.cpp Q8_0           the Q8_0 file

Each path's MFU is its tokens (prompt and generated) a second at its median time times 2 x the parameters, over
the matmul rate in the model's precision: the higher of the run's first reading (the machine's `fp32_gflops` or
`bf16_gflops`) and one taken as the section starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

from cbgen.bench.suite import Context, Goal, Plan, Row, Timings, ratio, skipped
from cbgen.bench.workloads import BenchWorkload, Measurement, warm_up

AHEAD = Goal(">=", 1.2)  # cbgen against llama.cpp at 1B, in the model's precision and in Q8_0
MFU = Goal(">=", 0.75)
INT8_SPEED = Goal(">=", 1.0)  # int8 against the model's precision: at least as fast
INVARIANCE_COST = Goal("<=", 1.05)  # batch invariance free at 1B too
FASTER = "how many times as fast cbgen is (the other path's median time over cbgen's)"
COST = "the first path's median time over the second's"
SHAPES = {"quick": ("llama-1b",), "full": ("llama-1b", "qwen3-4b")}
# bytes of RAM a shape needs a parameter: cbgen's float32 model (4) and its int8 and w8a8 ones (about 1.1 each),
# loaded side by side for the alternating rounds, llama.cpp's mapped f32 file (4) and Q8_0 file (about 1.1), slack
MEMORY_PER_PARAMETER = 13


def precision() -> tuple[str, str]:
    """The model's precision on this machine, as cbgen's dtype and llama.cpp's GGUF type: what `--dtype auto` picks on
    this CPU kind (or the kind it is held to): ("float32", "f32") on AVX2, ("bfloat16", "bf16") with bfloat16 units."""
    from cbgen.bench.llamacpp import GGUF_TYPES
    from cbgen.config.cpu import cpu_row

    dtype = cpu_row().dtype
    return dtype, GGUF_TYPES[dtype]


def goals(plan: Plan) -> tuple[tuple[str, Goal], ...]:
    dtype, gguf = precision()
    stock = (("invariant / stock linear layers, llama-1b", INVARIANCE_COST),) if plan.scale_stock else ()
    return ((f"cbgen {dtype} vs llama.cpp {gguf}, llama-1b", AHEAD), ("cbgen int8 vs llama.cpp Q8_0, llama-1b", AHEAD),
            (f"cbgen {dtype} MFU, llama-1b", MFU), (f"cbgen int8 vs cbgen {dtype}, llama-1b", INT8_SPEED)) + stock


def _w8a8_unfit() -> str | None:
    from cbgen.model.int8 import w8a8_unfit

    return w8a8_unfit()


def _converter() -> Path | None:
    from cbgen.bench.llamacpp import llamacpp_dir

    return next(iter(sorted(llamacpp_dir().glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))), None)


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def prepared(shape: str, log: Any) -> tuple[Path, Path, Path] | str:
    """(the model folder, its GGUF in the model's precision, its Q8_0 GGUF), made once and kept; or why this shape
    cannot run here."""
    from cbgen.bench.llamacpp import BUILD_HINT, llamacpp_dir
    from cbgen.model.source import RANDOM_SHAPES

    config = RANDOM_SHAPES[shape]
    parameters = _parameters(config)
    if parameters * MEMORY_PER_PARAMETER > _memory_bytes():
        needed, have = parameters * MEMORY_PER_PARAMETER / 2**30, _memory_bytes() / 2**30
        return (f"{shape} ({parameters / 1e9:.1f}B parameters) needs about {needed:.0f} GiB of memory (cbgen in "
                f"float32, int8 and w8a8 beside llama.cpp's files); this machine has {have:.0f} GiB")
    converter = _converter()
    if converter is None:
        return f"no llama.cpp converter ({BUILD_HINT})"
    root = llamacpp_dir() / "models" / shape
    gguf = precision()[1]
    folder, files = root / "hf", {kind: root / f"{shape}-{kind}.gguf" for kind in (gguf, "q8_0")}
    if not (folder / "config.json").is_file():
        log(f"making random weights of {shape} in {folder} (once)")
        _save_random(shape, folder)
    for kind, target in files.items():
        if not target.is_file():
            log(f"converting {shape} to {kind} GGUF with llama.cpp's script (once)")
            env = os.environ | {"PYTHONPATH": str(converter.parent / "gguf-py"), "HF_HUB_OFFLINE": "1"}
            done = subprocess.run([sys.executable, str(converter), str(folder), "--outtype", kind, "--outfile",
                                   str(target)], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                target.unlink(missing_ok=True)
                lines = (done.stderr or done.stdout).strip().splitlines()
                return f"llama.cpp's converter failed on {shape} ({kind}): {lines[-1] if lines else done.returncode}"
    return folder, files[gguf], files["q8_0"]


def _parameters(config: dict[str, Any]) -> int:
    hidden, layers, inter, vocab = (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"],
                                    config["vocab_size"])
    head = config.get("head_dim", hidden // config["num_attention_heads"])
    attention = hidden * head * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * (attention + 3 * hidden * inter) + embeddings


def _save_random(shape: str, folder: Path) -> None:
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    loaded = load_model(ModelSection(model=shape, dtype="float32", device="cpu"))
    partial_folder = folder.with_name(folder.name + ".partial")
    loaded.model.save_pretrained(partial_folder)
    loaded.tokenizer.save_pretrained(partial_folder)
    partial_folder.rename(folder)


def _workload(tokenizer: Any, plan: Plan) -> BenchWorkload:
    from cbgen.bench.workloads import build_workloads

    (fixed,) = build_workloads(tokenizer, "small", ["fixed"])  # prompts of 128 tokens
    requests, prompt_tokens, new_tokens = plan.scale_fixed
    return fixed.cut(requests, new_tokens, prompt_tokens)


def scale(ctx: Context) -> list[Row]:
    """The scale rows (see the module), one block of rows per shape of the plan."""
    if ctx.plan.size == "tiny":
        return []
    rows: list[Row] = []
    for shape in SHAPES[ctx.plan.mode]:
        ready = prepared(shape, ctx.log)
        if isinstance(ready, str):
            rows += [skipped("scale", name, ready, goal) for name, goal in goals(ctx.plan) if shape in name] or \
                [skipped("scale", f"cbgen vs llama.cpp, {shape}", ready)]
            continue
        rows += _shape_rows(ctx, shape, *ready)
    return rows


def _shape_rows(ctx: Context, shape: str, folder: Path, floats: Path, q8_0: Path) -> list[Row]:
    t = Timings(ctx.log)
    tokens, parameters, workload = _timed(ctx, t, shape, folder, floats, q8_0)
    return _rows(ctx, t, shape, tokens, parameters, workload)


def _timed(ctx: Context, t: Timings, shape: str, folder: Path, floats: Path, q8_0: Path
           ) -> tuple[dict[str, float], int, BenchWorkload]:
    """Every path of the shape timed into `t`, the paths alternately round after round (both cbgen models loaded
    and warmed first): (tokens a second by path at its median time, the model's parameters, the workload)."""
    from cbgen.bench.llamacpp import bindings
    from cbgen.bench.machine import parameter_count
    from cbgen.bench.paths import Bench
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    workload = None
    parameters = 0
    dtype, gguf = precision()
    float_path = f"cbgen {dtype}"
    # cbgen int8 runs the Q8_0 file llama.cpp runs: its int8 values read as they are (cbgen.model.q8_0), the rest of
    # the model in the model's precision, as `cbgen run --model FILE` would
    benches: dict[str, Bench] = {}
    paths = [(float_path, folder, "none"), ("cbgen int8", q8_0, "auto")]
    paths += [("cbgen w8a8", q8_0, "w8a8")] if _w8a8_unfit() is None else []
    for name, model, quantize in paths:
        settings = ModelSection(model=str(model), dtype=dtype, device="cpu", quantize=quantize)  # type: ignore[arg-type]
        loaded = load_model(settings)
        parameters = parameters or parameter_count(loaded.model)
        workload = workload or _workload(loaded.tokenizer, ctx.plan)
        benches[name] = Bench(loaded, {}, settings)
        benches[name].cbgen(warm_up(workload))
    assert workload is not None
    others = ((f"llama.cpp {gguf}", floats), ("llama.cpp Q8_0", q8_0)) if bindings()[1] is None else ()
    last: dict[str, Measurement] = {}  # each path's last measurement (its tokens)
    for _ in range(ctx.plan.scale_rounds):
        for name, bench in benches.items():
            last[name] = t.record(f"{name}, {shape}", partial(bench.cbgen, workload))
            if name == float_path and ctx.plan.scale_stock:  # batch invariance (the default) against stock layers
                t.record(f"{name} stock, {shape}", partial(bench.cbgen, workload, invariant=False))
        for other, file in others:
            last[other] = t.record(f"{other}, {shape}", partial(benches[float_path].llamacpp, workload, file,
                                                                 len(workload.prompts), last[float_path], other))
    # tokens a second at each path's median time (its prompt and generated tokens are the same in every round)
    tokens = {name: (m.prompt_tokens + m.generated_tokens) / t.median(f"{name}, {shape}") for name, m in last.items()}
    return tokens, parameters, workload


def _rows(ctx: Context, t: Timings, shape: str, tokens: dict[str, float], parameters: int,
          workload: BenchWorkload) -> list[Row]:
    import torch

    from cbgen.bench.llamacpp import bindings
    from cbgen.bench.machine import matmul_flops

    main = shape == "llama-1b"
    shape_text = f"{shape}, fixed, {len(workload.prompts)} x ({len(workload.prompts[0])} + {workload.max_new_tokens})"
    dtype, gguf = precision()
    float_path = f"cbgen {dtype}"
    # the higher of two readings of the matmul rate in the model's precision, the run's first and one now: a reading
    # disturbed by something else on the machine under-states the rate, and an MFU over it reads above 100 %
    first = ctx.machine.fp32_gflops if dtype == "float32" else ctx.machine.bf16_gflops
    peak = max(first * 1e9, matmul_flops(getattr(torch, dtype)))
    mfu = {name: rate * 2 * parameters / peak for name, rate in tokens.items()}
    note = "MFU: " + ", ".join(f"{name} {value:.0%}" for name, value in mfu.items())
    rows = []
    for ours, theirs in ((float_path, f"llama.cpp {gguf}"), ("cbgen int8", "llama.cpp Q8_0")):
        title = f"{ours} vs {theirs}, {shape}"
        rows.append(ratio("scale", title, t, f"{theirs}, {shape}", f"{ours}, {shape}", FASTER,
                          AHEAD if main else None, note=f"{shape_text}; {note}") if theirs in tokens
                    else skipped("scale", title, bindings()[1] or "llama.cpp did not run", AHEAD if main else None))
    rows.append(ratio("scale", f"cbgen int8 vs {float_path}, {shape}", t, f"{float_path}, {shape}",
                      f"cbgen int8, {shape}", FASTER, INT8_SPEED if main else None, note=shape_text))
    w8a8_note = f"{shape_text}; w8a8: int8 rows too, answers other than the dequantized model's (no goal)"
    for theirs in (float_path, "llama.cpp Q8_0"):
        title = f"cbgen w8a8 vs {theirs}, {shape}"
        if "cbgen w8a8" in tokens and theirs in tokens:
            rows.append(ratio("scale", title, t, f"{theirs}, {shape}", f"cbgen w8a8, {shape}", FASTER, None,
                              note=w8a8_note))
        else:  # _timed ran no w8a8 path where the kernel has no VNNI here
            unfit = _w8a8_unfit() if "cbgen w8a8" not in tokens else None
            rows.append(skipped("scale", title, unfit or bindings()[1] or "llama.cpp did not run"))
    if ctx.plan.scale_stock:
        rows.append(ratio("scale", f"invariant / stock linear layers, {shape}", t, f"{float_path}, {shape}",
                          f"{float_path} stock, {shape}", COST, INVARIANCE_COST if main else None, note=shape_text))
    rows.append(Row("scale", f"{float_path} MFU, {shape}", round(mfu[float_path], 3), "x",
                    f"tokens a second x 2 x parameters over the {dtype} matmul rate (the higher of two readings)",
                    MFU if main else None, note=note, exact=mfu[float_path],
                    paths={p: [round(s.value, 6) for s in t.samples[p]] for p in (f"{float_path}, {shape}",)},
                    busy=any(s.busy for s in t.samples[f"{float_path}, {shape}"])))
    for row in rows:
        row.dtype = dtype
    return rows
