"""`cbgen bench`: the same prompts through cbgen's engine path, plain `generate_batch` and static batching with
`model.generate`, measured side by side in one process, model load excluded from all.

Workloads are built from the model's own tokenizer and chat template, deterministically (a seed per workload):

  mixed          chat questions of varied length, each with its own max_new_tokens drawn from 16..256
  shared-prefix  a few long system prompts, each shared by many short questions; short answers
  long-prompt    long documents to summarise in a few tokens (prefill-heavy)
  many-small     many short questions, short answers
  structured     requests for JSON records (a person with name, age, status, tags, address), run by cbgen twice:
                 under the records' JSON schema (`cbgen-json-schema`), then as free text (`cbgen`) with each request
                 capped at the length of its constrained answer, so that both do the same work; only cbgen paths run

Paths: `cbgen` (prefix-gated admission, the default), `cbgen-ordered` (the same order, no gate), `cbgen-input-order`
(input order, no gate), `generate_batch` (transformers' entry point, same ContinuousBatchingConfig) and `static-B`
(`model.generate` on left-padded batches of B prompts, in input order).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cbgen.config import JobConfig, page_size
from cbgen.engine.engine import Engine
from cbgen.engine.plan import EnginePlan, plan_engine
from cbgen.engine.plan import Workload as EngineWorkload
from cbgen.errors import CbgenError
from cbgen.model.load import LoadedModel
from cbgen.prompts import LOOKAHEAD, prefix_aware_order
from cbgen.records import PromptRecord, Request

WORDS = (
    "river mountain engine harvest lantern market window silver garden theory signal orbit canvas thunder "
    "pattern bridge ocean library winter compass factory meadow crystal voyage rhythm castle planet forest "
    "machine ember quiet swift bright ancient hidden gentle distant golden frozen curious steady hollow "
    "measure explain compare describe imagine consider follow gather notice travel wonder balance"
).split()


@dataclass
class Workload:
    """Prompts and their caps. With per-request caps (`caps`), paths that cannot stop a request at its own cap
    (`generate_batch`, static batches) run to the largest cap and only tokens up to each request's cap count."""

    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    caps: list[int] | None = None
    schema: dict[str, Any] | None = None  # the structured workload's: the cbgen path also runs under it

    def cap(self, i: int) -> int:
        return self.caps[i] if self.caps else self.max_new_tokens


@dataclass
class Measurement:
    workload: str
    path: str
    seconds: float
    requests: int
    prompt_tokens: int
    generated_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.seconds

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.seconds


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _chat(tokenizer, user: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


SIZES = {  # requests per workload; "small" fits a 2-core CPU in a few minutes per path
    "tiny": {"mixed": 4, "shared-prefix": 8, "long-prompt": 2, "many-small": 8, "structured": 4},
    "small": {"mixed": 96, "shared-prefix": 64, "long-prompt": 8, "many-small": 128, "structured": 64},
    "medium": {"mixed": 128, "shared-prefix": 256, "long-prompt": 32, "many-small": 512, "structured": 256},
}
ROLES = "nurse pilot chef teacher farmer engineer painter librarian".split()
CITIES = "Paris Lagos Osaka Lima Oslo Denver Cairo Perth".split()
RECORD_SCHEMA = {  # the structured workload's: bounded, so that a small greedy model cannot loop inside a string
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "status", "tags", "address"],
    "additionalProperties": False,
}


def build_workloads(tokenizer, size: str = "small", names: Sequence[str] | None = None) -> list[Workload]:
    counts = SIZES[size]
    scale = {"tiny": 0.1, "small": 1.0, "medium": 1.0}[size]
    out = []
    for name in names or counts:
        rng = random.Random(name)
        n = counts[name]
        if name == "mixed":
            prompts = [_chat(tokenizer, " ".join(_sentence(rng, rng.randint(5, 20)) for _ in range(rng.randint(1, 6)))
                             + " Explain.") for _ in range(n)]
            top = 256 if size != "tiny" else 16
            out.append(Workload(name, prompts, top, [rng.randint(min(16, top), top) for _ in range(n)]))
        elif name == "shared-prefix":
            systems = [" ".join(_sentence(rng, 12) for _ in range(max(1, int(40 * scale)))) for _ in range(4)]
            prompts = [_chat(tokenizer, f"Question {i}: {_sentence(rng, 8)}", rng.choice(systems)) for i in range(n)]
            out.append(Workload(name, prompts, 8))
        elif name == "long-prompt":
            prompts = [_chat(tokenizer, " ".join(_sentence(rng, 14) for _ in range(max(1, int(70 * scale))))
                             + " Summarise in one sentence.") for _ in range(n)]
            out.append(Workload(name, prompts, 16))
        elif name == "many-small":
            prompts = [_chat(tokenizer, _sentence(rng, rng.randint(3, 10))) for _ in range(n)]
            out.append(Workload(name, prompts, 16))
        elif name == "structured":
            prompts = [_chat(tokenizer, f"Create a JSON record for a fictional {ROLES[i % 8]} who lives in "
                             f"{CITIES[i // 8 % 8]}, with name, age, status (active, inactive or pending), a few tags "
                             "and address (city and 5-digit zip).", "You output only JSON.") for i in range(n)]
            out.append(Workload(name, prompts, 160 if size != "tiny" else 24, schema=RECORD_SCHEMA))
        else:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(counts)}")
    return out


def _job(workload: Workload, batching: dict[str, Any], prefix_gating: bool = True) -> JobConfig:
    job = JobConfig()
    job.generation.max_new_tokens = workload.max_new_tokens
    job.batching = dict(batching)
    job.run.prefix_gating = prefix_gating
    return job


def _requests(workload: Workload) -> list[Request]:
    return [Request(PromptRecord(id=str(i), index=i, location=f"{workload.name}#{i}"), input_ids=ids,
                    max_new_tokens=workload.cap(i)) for i, ids in enumerate(workload.prompts)]


def _is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except ValueError:
        return False
    return True


def _useful(tokens: list[int], eos: set[int], cap: int) -> int:
    """Tokens a request really asked for: up to its end-of-sequence token, at most its cap."""
    stop = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
    return min(stop, cap)


class Bench:
    """Runs workloads through the paths on one loaded model, with one ContinuousBatchingConfig for all CB paths."""

    def __init__(self, loaded: LoadedModel, batching: dict[str, Any] | None = None) -> None:
        self.loaded = loaded
        self.batching = batching or {}

    def _plan(self, workload: Workload, prefix_gating: bool = True, constrained: bool = False
              ) -> tuple[JobConfig, EnginePlan, Any]:
        """The engine set-up `cbgen run` would make for these prompts (cbgen.engine.plan), and its step control
        (a cbgen.control.plan.StepPlan) when `constrained` puts the workload under its schema."""
        job = _job(workload, self.batching, prefix_gating)
        sized_for = EngineWorkload(longest_prompt=max(len(p) for p in workload.prompts),
                                   max_new_tokens=max([workload.max_new_tokens, *(workload.caps or [])]),
                                   num_return_sequences=1, requests=len(workload.prompts))
        steps = None
        if constrained:
            from cbgen.control.plan import StepPlan

            job.generation.json_schema = json.dumps(workload.schema)
            vocab = self.loaded.model.config.get_text_config().vocab_size
            steps = StepPlan.build(job, set(), self.loaded.tokenizer, vocab, job.do_sample)
        return job, plan_engine(job, self.loaded, sized_for, steps=steps), steps

    def cbgen(self, workload: Workload, order: str = "gated", constrained: bool = False) -> Measurement:
        """`constrained`: every request follows the workload's schema, compiled once before the clock starts (as
        `cbgen run` does it while reading)."""
        job, plan, steps = self._plan(workload, prefix_gating=order == "gated", constrained=constrained)
        engine = Engine(self.loaded.model, plan.engine_settings(job))
        requests = _requests(workload)
        if steps is not None:
            for request in requests:
                request.sampling, request.response_format, error = steps.request_kwargs(request.record.id, {}, None)
                assert error is None, error
        if order != "input":
            requests = prefix_aware_order(requests, key_tokens=page_size(plan.batching), lookahead=LOOKAHEAD,
                                          default_max_new_tokens=workload.max_new_tokens)
        start = time.perf_counter()
        generated = 0
        lengths = [0] * len(workload.prompts)
        stopped: list[list[int]] = []
        for group in engine.run(requests):
            assert group[0].finish_reason != "error", group[0].error
            generated += sum(len(c.token_ids) for c in group)
            lengths[group[0].request.record.index] = len(group[0].token_ids)
            stopped += [c.token_ids for c in group if c.finish_reason == "stop"]
        seconds = time.perf_counter() - start
        path = {"gated": "cbgen", "ordered": "cbgen-ordered", "input": "cbgen-input-order"}[order]
        extra: dict[str, Any] = {"cb": engine.stats.resolved_config, "lengths": lengths}
        if steps is not None:
            path += "-json-schema"
            extra["grammar_compile_s"] = round(steps.grammars.compile_seconds, 4)
            decode = self.loaded.tokenizer.decode
            extra["stopped_json"] = sum(_is_json(decode(t, skip_special_tokens=True)) for t in stopped)
            extra["stopped"] = len(stopped)
        return Measurement(workload.name, path, seconds, len(workload.prompts),
                           sum(map(len, workload.prompts)), generated, extra)

    def structured(self, workload: Workload, order: str = "gated") -> list[Measurement]:
        """The workload under its schema, then as free text capped request by request at the constrained answer's
        length: the same prompts and (up to early end-of-sequence) the same tokens, with and without the masks."""
        constrained = self.cbgen(workload, order, constrained=True)
        free = Workload(workload.name, workload.prompts, workload.max_new_tokens, caps=constrained.extra["lengths"])
        return [self.cbgen(free, order), constrained]

    def generate_batch(self, workload: Workload) -> Measurement:
        """One call for the whole workload; it has one max_new_tokens for all, so it runs to the largest cap."""
        _, plan, _ = self._plan(workload)
        eos = plan.eos_token_ids
        start = time.perf_counter()
        outputs = self.loaded.model.generate_batch(inputs=workload.prompts, generation_config=plan.generation_config,
                                                   continuous_batching_config=plan.spec.cb_config)
        seconds = time.perf_counter() - start
        assert len(outputs) == len(workload.prompts) and not any(o.error for o in outputs.values())
        # generate_batch returns results in input order (request ids req_0, req_1, ...)
        generated = sum(_useful(o.generated_tokens, eos, workload.cap(i)) for i, o in enumerate(outputs.values()))
        return Measurement(workload.name, "generate_batch", seconds, len(workload.prompts),
                           sum(map(len, workload.prompts)), generated)

    def static(self, workload: Workload, batch_size: int) -> Measurement:
        """`model.generate` on left-padded batches, in input order, each run to its largest cap; tokens after a
        sequence's EOS or cap are not counted."""
        _, plan, _ = self._plan(workload)
        generation_config, eos = plan.generation_config, plan.eos_token_ids
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
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config,
                                     max_new_tokens=max(caps))
            generated += sum(_useful(row, eos, cap) for row, cap in zip(out[:, width:].tolist(), caps))
        seconds = time.perf_counter() - start
        return Measurement(workload.name, f"static-{batch_size}", seconds, len(workload.prompts),
                           sum(map(len, workload.prompts)), generated)


def matmul_flops(dtype: torch.dtype = torch.bfloat16, seconds: float = 2.0, largest: int = 2048) -> float:
    """The machine's measured dense matmul rate (FLOP/s) in `dtype`, the denominator of model FLOP utilisation.
    Square sizes grow from 256 while one product takes under 0.1 s, so a dtype the CPU has no units for (bf16 on
    AVX2: about 1 GFLOP/s) is measured in seconds, not minutes."""
    n, rate = 256, 0.0
    while True:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        a @ b
        count, start = 0, time.perf_counter()
        while count < 2 or time.perf_counter() - start < seconds / 4:
            a @ b
            count += 1
        elapsed = time.perf_counter() - start
        rate = max(rate, 2 * n**3 * count / elapsed)
        if n >= largest or elapsed / count > 0.1:
            return rate
        n *= 2


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run_suite(
    loaded: LoadedModel,
    workloads: list[Workload],
    paths: Sequence[str],
    static_batch_sizes: Sequence[int] = (8, 16, 32),
    batching: dict[str, Any] | None = None,
    on_result: Callable[[Measurement], None] | None = None,
) -> list[Measurement]:
    bench = Bench(loaded, batching)
    results = []
    for workload in workloads:
        # first-call costs (kernel selection for this workload's shapes, allocator growth) are paid before measuring,
        # so that no path pays them for the others
        bench.cbgen(Workload("warm-up", workload.prompts[:8], 4), "input")
        for path in paths:
            if workload.schema is not None and not path.startswith("cbgen"):
                continue  # only cbgen can follow a schema; the structured workload compares cbgen with itself
            if path == "static":
                measured = [bench.static(workload, b) for b in static_batch_sizes]
            elif path == "generate_batch":
                measured = [bench.generate_batch(workload)]
            else:
                order = {"cbgen": "gated", "cbgen-ordered": "ordered", "cbgen-input-order": "input"}[path]
                measured = ([bench.cbgen(workload, order)] if workload.schema is None
                            else bench.structured(workload, order))
            for m in measured:
                results.append(m)
                if on_result:
                    on_result(m)
    return results


def summarise(results: list[Measurement], flops_per_token: float, peak_flops: float) -> list[dict[str, Any]]:
    """One row per measurement, with its wall-time ratio to cbgen on the same workload and its MFU."""
    cbgen_time = {m.workload: m.seconds for m in results if m.path == "cbgen"}
    cbgen_tokens = {m.workload: max(m.generated_tokens, 1) for m in results if m.path == "cbgen"}
    rows = []
    for m in results:
        rows.append({
            "workload": m.workload, "path": m.path, "seconds": round(m.seconds, 2), "requests": m.requests,
            "prompt_tokens": m.prompt_tokens, "generated_tokens": m.generated_tokens,
            "prompt_tok_s": round(m.prompt_tokens_per_s, 1), "generated_tok_s": round(m.generated_tokens_per_s, 1),
            "total_tok_s": round(m.total_tokens_per_s, 1),
            "time_vs_cbgen": round(m.seconds / cbgen_time[m.workload], 2) if m.workload in cbgen_time else None,
            # time per generated token, against cbgen's: for paths whose outputs differ in length (a schema)
            "token_time_vs_cbgen": (round(m.seconds / m.generated_tokens / (cbgen_time[m.workload] / cbgen_tokens[
                m.workload]), 2) if m.workload in cbgen_time and m.generated_tokens else None),
            **{k: v for k, v in m.extra.items() if k not in ("cb", "lengths")},
            "mfu": round(m.total_tokens_per_s * flops_per_token / peak_flops, 4),
        })
    return rows


def write_outputs(rows: list[dict[str, Any]], meta: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    """bench.json (rows + how they were measured) and bench.png (total tokens/s per workload and path)."""
    try:
        import matplotlib
    except ImportError:
        raise CbgenError("cbgen bench draws its chart with matplotlib: pip install 'cbgen[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "bench.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(workloads)), 4))
    width = 0.8 / len(paths)
    for j, path in enumerate(paths):
        values = [next((r["total_tok_s"] for r in rows if r["workload"] == w and r["path"] == path), 0)
                  for w in workloads]
        ax.bar([i + j * width for i in range(len(workloads))], values, width, label=path)
    ax.set_xticks([i + width * (len(paths) - 1) / 2 for i in range(len(workloads))], workloads)
    ax.set_ylabel("prompt + generated tokens / s")
    ax.set_title(f"cbgen bench: {meta.get('model')} ({meta.get('dtype')}, {meta.get('device')})")
    ax.legend(fontsize="small")
    fig.tight_layout()
    png_path = directory / "bench.png"
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path


def meta_for(loaded: LoadedModel, size: str, peak_flops: float, batching: dict[str, Any]) -> dict[str, Any]:
    return {"model": loaded.source.name, "dtype": str(loaded.dtype).removeprefix("torch."), "device": loaded.device,
            "attn_implementation": loaded.attn_implementation, "size": size,
            "parameters": parameter_count(loaded.model), "matmul_flops": round(peak_flops),
            "matmul_dtype": str(loaded.dtype).removeprefix("torch."),
            "batching_overrides": batching, "torch_threads": torch.get_num_threads(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


__all__ = ["Bench", "Measurement", "Workload", "build_workloads", "run_suite", "summarise", "write_outputs",
           "matmul_flops", "parameter_count", "meta_for"]
