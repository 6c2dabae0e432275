"""`cbgen run ... --dry-run`: what a job would do, found without generating anything.

Every row of the input (this shard's, for a split job) is read and rendered, streaming, with the tokenizer and the
model's configuration only (the model is built without weights, on torch's meta device): the report gives the rows,
the error records the job would write (with the first few reasons), the prompt tokens (total and longest), the
sequences it would generate at most, and the KV cache the engine would reserve, planned exactly as the job plans it.
With `--estimate-time`, the real model also answers a short sample of the requests and the report adds a wall-time
estimate, saying how it was made.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cbgen.config import JobConfig
from cbgen.parallel.sharding import resolve_sharding, shard_of
from cbgen.records import Request

SAMPLE = 16  # requests the estimate times
SHOWN_ERRORS = 5


@dataclass
class DryRunReport:
    rows: int = 0
    errors: int = 0  # error records the job would write
    first_errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    longest_prompt: int = 0
    max_sequences: int = 0  # sequences generated, counting each row's n
    max_generated_tokens: int = 0  # at most, if no sequence stops early
    kv_cache: dict[str, Any] = field(default_factory=dict)
    estimate: dict[str, Any] | None = None
    # the result cache: requests it would answer (exact hits, or near hits when the job takes them), and those it
    # holds computed with other numerics that the job would compute afresh; None when the job uses no cache
    cached: int | None = None
    cached_other_numerics: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dry_run(job: JobConfig, estimate: bool = False) -> DryRunReport:
    """The report for `job` (see the module's docstring); CbgenError for what the job itself would refuse."""
    from cbgen.engine.admission import Limits
    from cbgen.job.plan import used_settings
    from cbgen.job.sequence import open_job_input, plan_input, prepared, read_ahead
    from cbgen.model.load import load_model
    from cbgen.model.source import context_tokens, source_of
    from cbgen.result_cache import for_generation

    reader = open_job_input(job, context_tokens(source_of(job)))
    sharding = resolve_sharding(job)
    records = (r for r in reader if sharding is None or shard_of(r.id, sharding[1]) == sharding[0])
    structure = load_model(job.model, weights=False)
    head, whole = read_ahead(records)
    total = reader.count() if sharding is None else None
    planned = plan_input(job, structure, head, records, used_settings(reader.settings_present(), head), total,
                         reader.ids, whole)
    plan = planned.plan
    limits = Limits(job.generation.max_new_tokens, plan.engine.settings.max_positions)
    report = DryRunReport(kv_cache=dict(plan.engine.kv_cache) | {"num_blocks": plan.engine.batching.get("num_blocks")})
    runnable: list[Request] = []  # the first requests the cache does not answer: the estimate's sample
    to_compute = 0  # sequences the cache does not answer
    cache = for_generation(job, structure, plan)
    if cache is not None:
        cache.touch = False  # looking is not a use: the eviction order stays as runs left it
    for request in prepared(job, planned, ordered=False):  # in input order: the first errors are the input's first
        report.rows += 1
        reason = request.error or limits.never_fits(request)
        if reason is not None:
            report.errors += 1
            if len(report.first_errors) < SHOWN_ERRORS:
                report.first_errors.append(f"{request.record.location}: {reason}")
            continue
        if cache is not None:
            cache.answer(request)
        n = request.n or job.generation.num_return_sequences
        report.prompt_tokens += len(request.ids)
        report.longest_prompt = max(report.longest_prompt, len(request.ids))
        report.max_sequences += n
        report.max_generated_tokens += n * limits.max_new_for(request)
        if request.answered is None:
            to_compute += n
            if len(runnable) < SAMPLE:
                runnable.append(request)
    if cache is not None:
        report.cached = cache.counts.hits + cache.counts.near_hits
        report.cached_other_numerics = cache.counts.near_hits_skipped
    if estimate and runnable:
        report.estimate = _estimate(job, runnable, to_compute)
    return report


def _estimate(job: JobConfig, sample: list[Request], sequences_left: int) -> dict[str, Any]:
    """Times the sample's requests on the real model and scales by the sequences to compute (those the result cache
    does not answer): an upper bound for big jobs, whose batches are fuller than a sample's."""
    from cbgen.job.sequence import generate_in_memory
    from cbgen.model.load import load_model
    from cbgen.progress import NullProgress

    started = time.perf_counter()
    loaded = load_model(job.model)
    load_seconds = time.perf_counter() - started
    rows = [{"id": r.record.id, "input_ids": r.ids, **({"max_new_tokens": r.max_new_tokens}
                                                        if r.max_new_tokens else {})} for r in sample]
    sample_job = JobConfig(model=job.model, generation=job.generation, batching=dict(job.batching),
                           run=replace(job.run, result_cache=False))  # timed as computed
    started = time.perf_counter()
    results = generate_in_memory(sample_job, loaded, rows, NullProgress())
    seconds = time.perf_counter() - started
    sequences = max(len(results), 1)
    generated = sum(len(r["token_ids"]) for r in results)
    return {
        "sample_requests": len(sample), "sample_seconds": round(seconds, 2), "model_load_s": round(load_seconds, 2),
        "generated_tokens_per_s": round(generated / seconds, 1) if seconds else None,
        "estimated_generation_s": round(seconds * sequences_left / sequences, 1),
        "how": f"the first {len(sample)} runnable requests generated on the real model ({seconds:.1f} s), scaled "
               f"by sequences to the {sequences_left} the job computes: an upper bound, since the job's own batches "
               "are fuller; add the model load",
    }
