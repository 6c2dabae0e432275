"""The suite's comparisons, one function per section (cbgen.bench.suite runs them): each times its paths alternately
through a `Timings` and returns its rows, with the goals the project set for them.

  generation   cbgen against transformers' own `generate_batch` and llama.cpp (bf16 or f32, and Q8_0) on the fixed
               workload, 64 x (128 + 64) tokens: llama-batched-bench's shape (--quick: 16 x (128 + 32))
  scale        the same at the sizes people run: a 1B shape (and 4B where memory allows) against llama.cpp in the
               model's precision and Q8_0, cbgen's int8 weights against its float ones, and MFU (cbgen.bench.scale)
  invariance   batch-invariant linear layers (the default) against stock ones, per workload, in the machine's dtype
               and in float32
  sampling     seeded and unseeded sampling against greedy decoding, per generated token; every history control
               (penalties, min_p, min_tokens, logit_bias, bad words, the loop stop) on against off
  embedding    cbgen's embeddings against sentence-transformers', encode alone and as whole commands
  dedup        the dedup stage over planted near-duplicates
  start        a warm start and --help, as whole commands
"""

from __future__ import annotations

from functools import partial
from typing import Any

from cbgen.bench.scale import goals as scale_goals
from cbgen.bench.scale import scale
from cbgen.bench.suite import BF16_KINDS, Context, Goal, Plan, Row, Timings, ratio, seconds, skipped
from cbgen.bench.workloads import BenchWorkload, build_workloads

FASTER = "how many times as fast cbgen is (the other path's median time over cbgen's)"
COST = "the first path's median time over the second's (per generated token where it says so)"
CONTROLS = {"repetition_penalty": 1.1, "presence_penalty": 0.3, "frequency_penalty": 0.2, "no_repeat_ngram_size": 6,
            "min_p": 0.05, "min_tokens": 8, "logit_bias": {"28": -5}, "bad_words": ["delve", "tapestry"],
            "loop_stop": 4}
SEEDED, SAMPLED = (0.8, 1), (0.8, None)  # temperature and seed

# The goals the project set, each used by its section and listed per section below (a section that fails counts
# them as not measured)
AGAINST_GENERATE_BATCH = Goal(">=", 2.0)
AGAINST_LLAMACPP = Goal(">=", 1.3, BF16_KINDS)
INVARIANCE_COST = Goal("<=", 1.05)
SEEDED_COST = Goal("<=", 1.05)
CONTROLS_COST = Goal("<=", 1.10)
ENCODE = Goal(">=", 1.5)  # at 300 texts
COMMANDS = Goal(">=", 1.0)
DEDUP = Goal("<=", 60.0)  # at 100,000 vectors


def section_goals(name: str, plan: Plan) -> tuple[tuple[str, Goal], ...]:
    """The comparisons with a goal that section `name` measures under `plan`."""
    goals: dict[str, tuple[tuple[str, Goal], ...]] = {
        "generation": (("cbgen vs generate_batch", AGAINST_GENERATE_BATCH),
                       ("cbgen vs llama.cpp in the model's precision", AGAINST_LLAMACPP),
                       ("cbgen vs llama.cpp Q8_0", AGAINST_LLAMACPP)),
        "invariance": (("invariant / stock linear layers", INVARIANCE_COST),),
        "sampling": (("seeded / greedy, per token", SEEDED_COST),
                     ("every history control on / off, per token, seeded", CONTROLS_COST)),
        "embedding": ((("cbgen float32 vs sentence-transformers, encode, 300 texts", ENCODE),)
                      if 300 in plan.embed_texts else ()) + ((("cbgen embed vs a sentence-transformers script, whole "
                                                              "commands", COMMANDS),) if plan.command_texts else ()),
        "dedup": (("dedup of 100,000 vectors", DEDUP),) if plan.dedup_rows >= 100_000 else (),
        "scale": scale_goals(plan) if plan.size != "tiny" else ()}
    return goals.get(name, ())


def _bench(ctx: Context, dtype: str = "auto") -> Any:
    from cbgen.bench.paths import Bench
    from cbgen.config import ModelSection

    return Bench(ctx.generator(dtype), {}, ModelSection(model=ctx.model, dtype=dtype))  # type: ignore[arg-type]


def _warm(bench: Any, workload: BenchWorkload, **settings: Any) -> None:
    """First-call costs (kernel selection for the workload's shapes, allocator growth) paid off the clock."""
    bench.cbgen(BenchWorkload("warm-up", workload.prompts[:8], min(16, workload.max_new_tokens)), "input", **settings)


def _llamacpp_paths(ctx: Context, dtype_name: str) -> dict[str, tuple[Any, bool, str] | str]:
    """The llama.cpp paths, in the model's precision and in Q8_0: name -> (GGUF, repacked layouts, how it ran), or
    why it cannot run here."""
    from cbgen.bench.llamacpp import GGUF_TYPES, QUANTIZED, bindings, find_gguf, repack_works
    from cbgen.model.source import EMBEDDED_NAME

    embedded = ctx.generator().source.name == EMBEDDED_NAME
    paths: dict[str, tuple[Any, bool, str] | str] = {}
    for name, dtype in ((f"llama.cpp {GGUF_TYPES.get(dtype_name, dtype_name)}", dtype_name),
                        ("llama.cpp Q8_0", QUANTIZED)):
        gguf, why = find_gguf(None, embedded, dtype)
        if gguf is not None:
            why = bindings()[1]
        paths[name] = (why or "no GGUF file") if gguf is None or why else (gguf, *repack_works(gguf))
    return paths


def generation(ctx: Context) -> list[Row]:
    from cbgen.model import dtype_name

    bench = _bench(ctx)
    (fixed,) = map(ctx.plan.cut, build_workloads(bench.loaded.tokenizer, ctx.plan.size, ["fixed"]))
    llamacpp = _llamacpp_paths(ctx, dtype_name(bench.loaded.dtype))
    ready = {name: path for name, path in llamacpp.items() if not isinstance(path, str)}
    _warm(bench, fixed)
    t = Timings(ctx.log)
    for round_ in range(ctx.plan.generation_rounds):
        reference = t.record("cbgen", lambda: bench.cbgen(fixed))
        if round_ == 0:  # far slower than cbgen, against a goal it misses by far: one run says it
            t.record("generate_batch", lambda: bench.generate_batch(fixed))
        for name, (gguf, repack, _) in ready.items():
            t.record(name, partial(bench.llamacpp, fixed, gguf, len(fixed.prompts), reference, name, repack))
    shape = f"fixed, {len(fixed.prompts)} x ({len(fixed.prompts[0])} + {fixed.max_new_tokens})"
    rows = [ratio("generation", f"cbgen vs generate_batch, {shape}", t, "generate_batch", "cbgen", FASTER,
                  AGAINST_GENERATE_BATCH)]
    goal = AGAINST_LLAMACPP
    for name, path in llamacpp.items():
        title = f"cbgen vs {name}, {shape}"
        rows.append(skipped("generation", title, path, goal) if isinstance(path, str)
                    else ratio("generation", title, t, name, "cbgen", FASTER, goal, note=path[2]))
    return rows


def invariance(ctx: Context) -> list[Row]:
    """Batch-invariant linear layers (the default) against stock ones (--no-batch-invariant)."""
    from cbgen.model import dtype_name

    rows = []
    float32 = ctx.plan.invariance_float32 and dtype_name(ctx.generator().dtype) != "float32"
    dtypes = ["auto"] + (["float32"] if float32 else [])
    for dtype in dtypes:
        # float32 beside a bf16 machine's own dtype: a round fewer (its jobs take twice as long)
        rounds = ctx.plan.rounds if dtype == "auto" else max(1, ctx.plan.rounds - 1)
        bench = _bench(ctx, dtype)
        name = dtype_name(bench.loaded.dtype)
        workloads = [ctx.plan.cut(w) for w in build_workloads(bench.loaded.tokenizer, ctx.plan.size,
                                                               list(ctx.plan.invariance_workloads))]
        for workload in workloads:
            for invariant in (True, False):
                _warm(bench, workload, invariant=invariant)
        t = Timings(ctx.log)
        for _ in range(rounds):
            for w in workloads:
                t.record(f"{w.name} {name} invariant", partial(bench.cbgen, w, invariant=True))
                t.record(f"{w.name} {name} stock", partial(bench.cbgen, w, invariant=False))
        for w in workloads:
            rows.append(ratio("invariance", f"invariant / stock linear layers, {w.name}, {name}", t,
                              f"{w.name} {name} invariant", f"{w.name} {name} stock", COST, INVARIANCE_COST))
            rows[-1].dtype = name
    return rows


def sampling(ctx: Context) -> list[Row]:
    bench = _bench(ctx)
    (workload,) = map(ctx.plan.cut, build_workloads(bench.loaded.tokenizer, ctx.plan.size, ["sampling"]))
    cases: dict[str, dict[str, Any]] = {"greedy": {}, "sampled": {"sampling": SAMPLED}, "seeded": {"sampling": SEEDED},
             "seeded, every history control": {"sampling": SEEDED, "generation": CONTROLS}}
    if ctx.plan.mode == "quick":
        del cases["sampled"]  # no goal: the full run times it
    for settings in cases.values():
        _warm(bench, workload, **settings)
    t = Timings(ctx.log)
    for _ in range(ctx.plan.rounds):
        for case, settings in cases.items():
            t.record(case, partial(bench.cbgen, workload, **settings), per_token=True)
    shape = f"{len(workload.prompts)} requests, {workload.max_new_tokens} new tokens"
    rows = [ratio("sampling", f"seeded / greedy, per token ({shape})", t, "seeded", "greedy", COST, SEEDED_COST),
            ratio("sampling", f"every history control on / off, per token, seeded ({shape})", t,
                  "seeded, every history control", "seeded", COST, CONTROLS_COST)]
    if "sampled" in cases:
        rows.insert(1, ratio("sampling", f"sampled / greedy, per token ({shape})", t, "sampled", "greedy", COST))
    return rows


def embedding(ctx: Context) -> list[Row]:
    import cbgen
    from cbgen.bench import embedding as e
    from cbgen.model.source import embedded_embedder_path

    location = ctx.embed_model or str(embedded_embedder_path())
    embedders = {"float32": cbgen.Embedder(location, dtype="float32")}
    default = cbgen.Embedder(location)
    name = str(default.loaded.dtype).removeprefix("torch.")
    if name != "float32":
        embedders[name] = default
    reference = e.sentence_transformers_model(location)
    for call in e.encode_paths(e.real_texts(64), embedders, reference).values():
        call()  # warm-up: first-call costs off the clock
    rows = []
    for count in ctx.plan.embed_texts:
        texts = e.real_texts(count)
        paths = e.encode_paths(texts, embedders, reference)
        t = Timings(ctx.log)
        vectors: dict[str, Any] = {}
        for _ in range(ctx.plan.rounds if count <= 1_000 else 1):
            for path, call in paths.items():
                vectors[path] = t.record(f"{path}, {count} texts", call)
        for dtype in embedders:
            cosine = e.lowest_cosine(vectors[f"cbgen {dtype}"], vectors["sentence-transformers"])
            rows.append(ratio("embedding", f"cbgen {dtype} vs sentence-transformers, encode, {count} texts", t,
                              f"sentence-transformers, {count} texts", f"cbgen {dtype}, {count} texts", FASTER,
                              ENCODE if count == 300 else None, note=f"lowest cosine {cosine:.6f}"))
            rows[-1].dtype = dtype
    for i, count in enumerate(ctx.plan.command_texts):
        commands = e.command_paths(e.real_texts(count), ctx.folder, location)
        if i == 0 and ctx.plan.mode == "full":  # quick: the encode comparisons built the kernel, read the files
            for call in commands.values():
                call()  # warm-up, once: file caches, the kernel's build
        t = Timings(ctx.log)
        for _ in range(ctx.plan.rounds if count <= 1_000 else 1):
            for path, call in commands.items():
                t.record(f"{path}, {count} texts", call)
        rows.append(ratio("embedding", f"cbgen embed vs a sentence-transformers script, whole commands, {count} texts",
                          t, f"sentence-transformers script, {count} texts", f"cbgen embed, {count} texts", FASTER,
                          COMMANDS, note=f"cbgen in its default dtype ({name}), Parquet out; the script "
                          "writes .npy"))
        rows[-1].dtype = name
    return rows


def dedup(ctx: Context) -> list[Row]:
    from cbgen.bench.embedding import dedup_seconds

    rows = ctx.plan.dedup_rows
    t = Timings(ctx.log)
    quality: dict[str, Any] = {}

    def run() -> float:
        took, found = dedup_seconds(rows)
        quality.update(found)
        return took

    t.record(f"dedup, {rows:,} vectors", run)
    return [_no_model(seconds("dedup", f"dedup of {rows:,} vectors of 384 (5 % planted copies, threshold 0.95)", t,
                    f"dedup, {rows:,} vectors", "seconds", DEDUP if rows >= 100_000 else None,
                    note=f"recall {quality.get('recall')}, precision {quality.get('precision')}"))]


def start(ctx: Context) -> list[Row]:
    from cbgen.bench.commands import start_paths

    paths = start_paths(ctx.folder, ctx.model)
    t = Timings(ctx.log)
    for _ in range(3 if ctx.plan.mode == "full" else 1):
        for path, call in paths.items():
            t.record(path, call)
    return [_no_model(seconds("start", name, t, name, "seconds from process start to exit")) for name in paths]


def _no_model(row: Row) -> Row:
    row.dtype = ""  # no model's dtype applies (a whole command's is its own default)
    return row


SECTIONS = {"generation": generation, "scale": scale, "invariance": invariance, "sampling": sampling,
            "embedding": embedding, "dedup": dedup, "start": start}
