"""`cbgen bench`'s paths: the same prompts through cbgen's engine path, plain `generate_batch` and static batching
with `model.generate`, measured side by side in one process, model load excluded from all.

Paths: `cbgen` (prefix-gated admission, the default), `cbgen-ordered` (the same order, no gate), `cbgen-input-order`
(input order, no gate), the `cbgen` path with one setting changed on the same loaded model (cbgen.bench.registry:
`cbgen-invariant`, `cbgen-variant`, `cbgen-eager`, `cbgen-onednn`), `generate_batch` (transformers' entry point,
same ContinuousBatchingConfig), `static-B` (`model.generate` on left-padded batches of B prompts, in input order) and
`llamacpp` (the same token ids through llama.cpp: cbgen.bench.llamacpp).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cbgen.bench.registry import BENCH_PATHS
from cbgen.bench.workloads import BenchWorkload, Measurement, warm_up
from cbgen.config import JobConfig, ModelSection
from cbgen.engine.scope import ScopePlan
from cbgen.errors import CbgenError
from cbgen.inputs.base import IdChoice
from cbgen.job.sequence import Planned, make_engine, plan_input, prepared
from cbgen.model.load import LoadedModel
from cbgen.records import PromptRecord

# the sampling workload's variants: path suffix, temperature, seed, --batch-invariant
SAMPLING = (("", None, None, None), ("-sampled", 0.8, None, None), ("-seeded", 0.8, 1, False),
            ("-seeded-invariant", 0.8, 1, True))


def _job(workload: BenchWorkload, batching: dict[str, Any], prefix_gating: bool = True,
         invariant: bool | None = None, sampling: tuple[float | None, int | None] = (None, None),
         model: ModelSection | None = None, onednn: bool = False, compiled: bool | None = None,
         ops: bool | None = None, linear_kernel: bool | None = None, generation: dict[str, Any] | None = None
         ) -> JobConfig:
    job = JobConfig()
    if model is not None:
        job.model = dataclasses.replace(model)
    job.model.onednn_linear = job.model.onednn_linear or onednn
    if compiled is not None:
        job.model.compiled_attention = compiled
    if ops is not None:
        job.model.compiled_ops = ops
    if linear_kernel is not None:
        job.model.compiled_linear = linear_kernel
    job.generation.max_new_tokens = workload.max_new_tokens
    job.generation.temperature, job.generation.seed = sampling
    job.batching = dict(batching)
    job.run.prefix_gating = prefix_gating
    job.model.batch_invariant = invariant
    for key, value in (generation or {}).items():  # other generation settings (the history controls)
        setattr(job.generation, key, value)
    return job


def _records(workload: BenchWorkload) -> list[PromptRecord]:
    """The workload's prompts as input rows: token ids, each with its own cap when the workload has caps."""
    return [PromptRecord(id=str(i), index=i, location=f"{workload.name}#{i}", input_ids=list(ids),
                         settings={"max_new_tokens": workload.cap(i)} if workload.caps else {})
            for i, ids in enumerate(workload.prompts)]


def _is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except ValueError:
        return False
    return True


def _useful(tokens: list[int], eos: frozenset[int], cap: int) -> int:
    """Tokens a request really asked for: up to its end-of-sequence token, at most its cap."""
    stop = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
    return min(stop, cap)


class Bench:
    """Runs workloads through the paths on one loaded model (loaded with `model`'s settings), with one
    ContinuousBatchingConfig for all CB paths."""

    def __init__(self, loaded: LoadedModel, batching: dict[str, Any] | None = None,
                 model: ModelSection | None = None) -> None:
        self.loaded = loaded
        self.batching = batching or {}
        self.model = model

    def _plan(self, workload: BenchWorkload, prefix_gating: bool = True, constrained: bool = False,
              invariant: bool | None = None, sampling: tuple[float | None, int | None] = (None, None),
              onednn: bool = False, compiled: bool | None = None, ops: bool | None = None,
              linear_kernel: bool | None = None, generation: dict[str, Any] | None = None
              ) -> tuple[JobConfig, Planned]:
        """The plan `cbgen run` would make for these prompts (cbgen.job.sequence.plan_input), under the workload's
        schema when `constrained`, with the requests rendered as it renders them."""
        from cbgen.job.plan import used_settings

        job = _job(workload, self.batching, prefix_gating, invariant, sampling, self.model, onednn, compiled, ops,
                   linear_kernel, generation)
        if constrained:
            job.generation.json_schema = json.dumps(workload.schema)
        records = _records(workload)
        return job, plan_input(job, self.loaded, records, iter(()), used_settings(None, records), len(records),
                               IdChoice(None, "bench"), whole=True)

    def scope(self, **settings: Any) -> ScopePlan:
        """What the cbgen path (with `cbgen`'s keywords `settings`) installs for its engine on this model."""
        return self._plan(BenchWorkload("plan", [[1, 2, 3]], 1), **settings)[1].plan.engine.scope

    def cbgen(self, workload: BenchWorkload, order: str = "gated", constrained: bool = False,
              invariant: bool | None = None, sampling: tuple[float | None, int | None] = (None, None),
              onednn: bool = False, compiled: bool | None = None, ops: bool | None = None,
              linear_kernel: bool | None = None, generation: dict[str, Any] | None = None) -> Measurement:
        """`constrained`: every request follows the workload's schema, compiled once before the clock starts (as
        `cbgen run` does it while reading). `invariant`: --batch-invariant or --no-batch-invariant (None: the
        default); `sampling`: the temperature and seed (default: greedy); `onednn`: --onednn-linear; `compiled`:
        --compiled-attention or --no-compiled-attention; `ops`: --compiled-ops or --no-compiled-ops; `linear_kernel`:
        --compiled-linear or --no-compiled-linear; `generation`: other generation settings by name."""
        job, planned = self._plan(workload, prefix_gating=order == "gated", constrained=constrained,
                                  invariant=invariant, sampling=sampling, onednn=onednn, compiled=compiled, ops=ops,
                                  linear_kernel=linear_kernel, generation=generation)
        plan, grammars = planned.plan, planned.grammars
        engine = make_engine(job, planned, self.loaded)
        requests = list(prepared(job, planned, ordered=order != "input"))
        assert all(r.error is None for r in requests), next(r.error for r in requests if r.error)
        start = time.perf_counter()
        generated = 0
        tokens: list[list[int]] = [[] for _ in workload.prompts]
        stopped: list[list[int]] = []
        for group in engine.run(requests):
            assert group[0].finish_reason != "error", group[0].error
            generated += sum(len(c.token_ids) for c in group)
            tokens[group[0].request.record.index] = list(group[0].token_ids)
            stopped += [c.token_ids for c in group if c.finish_reason == "stop"]
        seconds = time.perf_counter() - start
        path = {"gated": "cbgen", "ordered": "cbgen-ordered", "input": "cbgen-input-order"}[order]
        extra: dict[str, Any] = {"cb": engine.stats.resolved_config, "tokens": tokens,
                                 "batch_invariant": plan.engine.scope.batch_invariant}
        if grammars is not None:
            path += "-json-schema"
            extra["grammar_compile_s"] = round(grammars.compile_seconds, 4)
            text = self.loaded.tokenizer.batch_decode(stopped, skip_special_tokens=True)
            extra["stopped_json"] = sum(_is_json(t) for t in text)
            extra["stopped"] = len(stopped)
        return Measurement(workload.name, path, seconds, len(workload.prompts),
                           sum(map(len, workload.prompts)), generated, extra)

    def variant(self, workload: BenchWorkload, path: str, earlier: Sequence[Measurement]) -> list[Measurement]:
        """The cbgen path with the settings of BENCH_PATHS[path], after a warm-up of its own (under a schema only for
        cbgen-onednn); each row adds the share of requests whose greedy tokens equal those of the same path without
        the change, when it ran earlier on this workload (`earlier`)."""
        settings = BENCH_PATHS[path].settings
        if workload.schema is not None and path != "cbgen-onednn":
            return []
        self.cbgen(BenchWorkload("warm-up", workload.prompts[:8], 4), "input", **settings)
        measured = ([self.cbgen(workload, **settings)] if workload.schema is None
                    else self.structured(workload, **settings))
        for m in measured:
            reference = next((r for r in earlier if r.path == m.path and "tokens" in r.extra), None)
            m.path = m.path.replace("cbgen", path, 1)
            if reference is not None:
                m.extra["same_tokens_as_cbgen"] = same_share(m.extra["tokens"], reference.extra["tokens"])
        return measured

    def sampling(self, workload: BenchWorkload) -> list[Measurement]:
        """The workload greedy, sampled, seeded and seeded batch-invariant (SAMPLING), each after a warm-up of its
        own: what sampling costs per generated token against greedy decoding."""
        measured = []
        for suffix, temperature, seed, invariant in SAMPLING:
            self.cbgen(BenchWorkload("warm-up", workload.prompts[:8], 4), "input", invariant=invariant,
                       sampling=(temperature, seed))
            m = self.cbgen(workload, invariant=invariant, sampling=(temperature, seed))
            m.path += suffix
            measured.append(m)
        return measured

    def structured(self, workload: BenchWorkload, order: str = "gated", **settings: Any) -> list[Measurement]:
        """The workload under its schema, then as free text capped request by request at the constrained answer's
        length: the same prompts and (up to early end-of-sequence) the same tokens, with and without the masks.
        `settings`: `cbgen`'s keywords (a variant path's)."""
        constrained = self.cbgen(workload, order, constrained=True, **settings)
        caps = [len(tokens) for tokens in constrained.extra["tokens"]]
        free = BenchWorkload(workload.name, workload.prompts, workload.max_new_tokens, caps=caps)
        return [self.cbgen(free, order, **settings), constrained]

    def generate_batch(self, workload: BenchWorkload) -> Measurement:
        """One call for the whole workload; it has one max_new_tokens for all, so it runs to the largest cap."""
        engine = self._plan(workload)[1].plan.engine
        eos = engine.eos_token_ids
        start = time.perf_counter()
        outputs = self.loaded.model.generate_batch(inputs=workload.prompts, generation_config=engine.generation_config,
                                                   continuous_batching_config=engine.settings.spec.cb_config)
        seconds = time.perf_counter() - start
        assert len(outputs) == len(workload.prompts) and not any(o.error for o in outputs.values())
        # generate_batch returns results in input order (request ids req_0, req_1, ...)
        generated = sum(_useful(o.generated_tokens, eos, workload.cap(i)) for i, o in enumerate(outputs.values()))
        return Measurement(workload.name, "generate_batch", seconds, len(workload.prompts),
                           sum(map(len, workload.prompts)), generated)

    def static(self, workload: BenchWorkload, batch_size: int) -> Measurement:
        """`model.generate` on left-padded batches, in input order, each run to its largest cap; tokens after a
        sequence's EOS or cap are not counted."""
        engine = self._plan(workload)[1].plan.engine
        generation_config, eos = engine.generation_config, engine.eos_token_ids
        pad = generation_config.pad_token_id
        model = self.loaded.model
        generated = 0
        start = time.perf_counter()
        for i in range(0, len(workload.prompts), batch_size):
            batch = workload.prompts[i : i + batch_size]
            caps = [workload.cap(k) for k in range(i, i + len(batch))]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
            with torch.no_grad():
                # transformers types generate's self as a protocol a PreTrainedModel does not match, for mypy
                out = model.generate(input_ids=ids, attention_mask=mask,  # type: ignore[misc]
                                     generation_config=generation_config, max_new_tokens=max(caps))
            generated += sum(_useful(row, eos, cap) for row, cap in zip(out[:, width:].tolist(), caps))
        seconds = time.perf_counter() - start
        return Measurement(workload.name, f"static-{batch_size}", seconds, len(workload.prompts),
                           sum(map(len, workload.prompts)), generated)

    def llamacpp(self, workload: BenchWorkload, gguf: Path, parallel: int, reference: Measurement | None = None,
                 path: str = "llamacpp", repack: bool | None = None) -> Measurement:
        """The workload's token ids through llama.cpp (`gguf`), at most `parallel` sequences at a time, each stopping
        at its cap or end of sequence; `reference` (cbgen's measurement of the same workload) adds the share of
        requests whose greedy tokens are the same in both."""
        from cbgen.bench.llamacpp import LlamaCpp, bindings

        lib, reason = bindings()
        if lib is None:
            raise RuntimeError(reason)
        n = len(workload.prompts)
        caps = [workload.cap(i) for i in range(n)]
        eos = self._plan(workload)[1].plan.engine.eos_token_ids
        longest = max(len(p) + c for p, c in zip(workload.prompts, caps))
        engine = LlamaCpp(lib, gguf, torch.get_num_threads(), min(parallel, n), -(-longest // 256) * 256,
                          repack=repack)
        try:
            warm = warm_up(workload)  # first-call costs, off the clock
            engine.run(warm.prompts, [warm.max_new_tokens] * len(warm.prompts), eos)
            run = engine.run(workload.prompts, caps, eos)
        finally:
            engine.close()
        extra: dict[str, Any] = {"gguf": gguf.name, "llamacpp_parallel": min(parallel, n)}
        if reference is not None and "tokens" in reference.extra:
            extra["same_tokens_as_cbgen"] = same_share(run.tokens, reference.extra["tokens"])
        return Measurement(workload.name, path, run.seconds, n, sum(map(len, workload.prompts)),
                           sum(map(len, run.tokens)), extra)


def _scoring(loaded: LoadedModel, workload: BenchWorkload, paths: Sequence[str], batch_sizes: Sequence[int]
             ) -> list[Measurement]:
    """The scoring workload's paths (cbgen.bench.scoring): `cbgen` is the scorer as `cbgen score` runs it,
    `cbgen-variant` with --no-batch-invariant (padded batches where the default packs rows), `static` the padded
    forward loop at each batch size; the generation paths do not apply."""
    from cbgen.bench import scoring

    warm_up = BenchWorkload("warm-up", workload.prompts[:8], 0, continuations=(workload.continuations or [])[:8],
                            choices=(workload.choices or [])[:8])
    scoring.scorer(loaded, warm_up)  # first-call costs, off the clock
    measurement, reference = scoring.scorer(loaded, workload)
    measured = [measurement] if "cbgen" in paths else []
    if "cbgen-variant" in paths:
        scoring.scorer(loaded, warm_up, invariant=False)
        measured.append(scoring.scorer(loaded, workload, invariant=False, path="cbgen-variant")[0])
    if "static" in paths:
        measured += [scoring.padded_forward(loaded, workload, b, reference) for b in batch_sizes]
    return measured


def same_share(tokens: Sequence[list[int]], reference: Sequence[list[int]]) -> float:
    """The share of requests whose generated tokens are the same in both runs (request by request, in workload
    order)."""
    return round(sum(a == b for a, b in zip(tokens, reference)) / max(len(reference), 1), 3)


def run_suite(
    loaded: LoadedModel,
    workloads: list[BenchWorkload],
    paths: Sequence[str],
    static_batch_sizes: Sequence[int] = (8, 16, 32),
    batching: dict[str, Any] | None = None,
    on_result: Callable[[Measurement], None] | None = None,
    llamacpp_model: Path | None = None,
    llamacpp_parallel: int = 64,
    model: ModelSection | None = None,
    llamacpp_quantized: Path | None = None,
) -> list[Measurement]:
    """`llamacpp_model`: the GGUF file the `llamacpp` path runs (cbgen.bench.llamacpp.find_gguf), and
    `llamacpp_quantized` the `llamacpp-q8_0` path's; `model`: the settings `loaded` was loaded with (--onednn-linear
    applies to every cbgen path)."""
    bench = Bench(loaded, batching, model)
    results: list[Measurement] = []
    for workload in workloads:
        if workload.continuations is not None:  # nothing generated: the scorer against padded forward passes
            measured = _scoring(loaded, workload, paths, static_batch_sizes)
            results += measured
            for m in measured:
                if on_result:
                    on_result(m)
            continue
        # first-call costs (kernel selection for this workload's shapes, allocator growth) are paid before measuring,
        # so that no path pays them for the others
        bench.cbgen(BenchWorkload("warm-up", workload.prompts[:8], 4), "input")
        for path in paths:
            if (workload.schema is not None or workload.sampling) and not path.startswith("cbgen"):
                continue  # only cbgen can follow a schema; the structured workload compares cbgen with itself
            spec = BENCH_PATHS[path]
            earlier = [m for m in results if m.workload == workload.name]
            if workload.sampling:  # cbgen with itself, greedy against sampled
                measured = bench.sampling(workload) if path == "cbgen" else []
            elif spec.runs == "static":
                measured = [bench.static(workload, b) for b in static_batch_sizes]
            elif spec.runs == "generate_batch":
                measured = [bench.generate_batch(workload)]
            elif spec.runs == "variant":
                measured = bench.variant(workload, path, earlier)
            elif spec.runs == "llamacpp":
                gguf = llamacpp_model if spec.gguf_flag == "--llamacpp-model" else llamacpp_quantized
                if gguf is None:
                    raise CbgenError(f"the {path} path needs the GGUF file llama.cpp runs ({spec.gguf_flag})")
                reference = next((m for m in earlier if m.path == "cbgen"), None)
                measured = [bench.llamacpp(workload, gguf, llamacpp_parallel, reference, path)]
            else:
                order = spec.order or "gated"
                measured = ([bench.cbgen(workload, order)] if workload.schema is None
                            else bench.structured(workload, order))
            for m in measured:
                results.append(m)
                if on_result:
                    on_result(m)
    return results
