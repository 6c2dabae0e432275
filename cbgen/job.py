"""One generation job from input file to output directory: the library entry point behind `cbgen run`."""

from __future__ import annotations

import itertools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path
from typing import Any, Protocol

from cbgen import __version__
from cbgen.config import JobConfig
from cbgen.engine import Completion, Engine
from cbgen.errors import CbgenError, ExitCode
from cbgen.inputs import open_reader
from cbgen.model import LoadedModel, load_model
from cbgen.outputs import open_writer
from cbgen.prompts import Renderer, Request, prefix_aware_order

MANIFEST = "run.json"
LOOKAHEAD = 1024  # requests rendered ahead: sizes the KV cache and is the window of the prefix-aware order

# CPU defaults, measured on a 2-core AVX-512/AMX machine with SmolLM2-135M (see README, "Performance"): the stock
# paged|sdpa path attends over every request's KV at once, so throughput falls past a few dozen sequences per step.
CPU_BATCHING_DEFAULTS = {"max_requests_per_batch": 16, "max_batch_tokens": 1024}
KV_MEMORY_SHARE = 0.25  # on CPU, the KV cache cbgen sizes never takes more than this share of available RAM


class ProgressSink(Protocol):
    """What a job reports as it goes. The CLI turns these calls into a Rich display or plain log lines."""

    def stage(self, message: str) -> None: ...
    def start(self, total: int | None) -> None: ...
    def advance(self, sequences: int, prompt_tokens: int, generated_tokens: int, failed: int) -> None: ...
    def finish(self) -> None: ...


class NullProgress:
    def stage(self, message: str) -> None: ...
    def start(self, total: int | None) -> None: ...
    def advance(self, sequences: int, prompt_tokens: int, generated_tokens: int, failed: int) -> None: ...
    def finish(self) -> None: ...


@dataclass
class RunSummary:
    """What a finished job did; also the core of run.json."""

    output_dir: Path
    model: str
    requests: int = 0
    sequences: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    shards: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    kv_cache: dict[str, Any] = field(default_factory=dict)
    engine_restarts: int = 0

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.SOME_FAILED if self.failed else ExitCode.OK

    @property
    def generation_seconds(self) -> float:
        return self.timings.get("generation_s", 0.0)

    def throughput(self) -> dict[str, float]:
        seconds = self.generation_seconds or float("nan")
        return {
            "generated_tokens_per_s": round(self.generated_tokens / seconds, 2),
            "total_tokens_per_s": round((self.generated_tokens + self.prompt_tokens) / seconds, 2),
            "requests_per_s": round(self.requests / seconds, 3),
        }


def prepare_output_dir(directory: Path, overwrite: bool) -> None:
    """Refuses to mix results of two runs in one directory; with `overwrite`, removes the earlier results."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise CbgenError(f"output directory '{directory}' is a file; choose another with -o")
    earlier = [p for p in directory.iterdir() if p.name.startswith(("part-", ".part-")) or p.name == MANIFEST]
    if earlier and not overwrite:
        raise CbgenError(
            f"output directory '{directory}' already holds results of an earlier run; "
            "pass --overwrite to replace them, or choose another directory with -o"
        )
    for path in earlier:
        path.unlink()


def build_generation_config(job: JobConfig, loaded: LoadedModel):
    """The GenerationConfig for the job. Starts from transformers' defaults, not the model's generation_config: a
    job's sampling is exactly what its configuration says. End-of-sequence tokens come from the model and tokenizer,
    plus --stop-token-ids."""
    from transformers import GenerationConfig

    g = job.generation
    eos = set(job.generation.stop_token_ids)
    for source in (getattr(loaded.model, "generation_config", None), loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        eos.update([value] if isinstance(value, int) else (value or []))
    sampling = {}
    if job.do_sample:
        sampling = {k: v for k, v in (("temperature", g.temperature), ("top_p", g.top_p), ("top_k", g.top_k)) if v}
        sampling.setdefault("top_k", None)  # transformers' default top_k=50 would silently truncate sampling
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    config = GenerationConfig(
        max_new_tokens=g.max_new_tokens,
        do_sample=job.do_sample,
        num_return_sequences=g.num_return_sequences,
        eos_token_id=sorted(eos) if eos else None,
        pad_token_id=pad if pad is not None else (min(eos) if eos else None),
        **sampling,
    )
    return config, eos


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_bytes_per_block(model_config, page_size: int, dtype_bytes: int) -> int:
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * heads * head_dim * page_size * dtype_bytes


def plan_batching(
    job: JobConfig, loaded: LoadedModel, longest_prompt: int, max_positions: int | None
) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """The ContinuousBatchingConfig fields, the in-flight window and a record of how the KV cache was sized.

    On CPU the engine's default cache takes a share of *system RAM* (measured: 10 GB for one request on SmolLM2 and
    13 s of warm-up), so unless the user sized it, cbgen gives it room for the window of requests it keeps in flight:
    each as long as the longest prompt seen in the first rows plus max_new_tokens.
    """
    batching = dict(job.batching)
    on_cpu = loaded.device == "cpu"
    if on_cpu:
        for key, value in CPU_BATCHING_DEFAULTS.items():
            batching.setdefault(key, value)
    window = job.run.max_in_flight or 2 * batching.get("max_requests_per_batch", 256)
    page_size = batching.get("page_size", 256)
    per_request = longest_prompt + job.generation.max_new_tokens
    if max_positions:
        per_request = min(per_request, max_positions)
    sizing: dict[str, Any] = {"page_size": page_size, "max_in_flight": window}
    if "num_blocks" in batching:
        sizing["chosen_by"] = "user (num_blocks)"
    elif "max_memory_percent" in batching or not on_cpu:
        sizing["chosen_by"] = "transformers, from max_memory_percent of free device memory"
    else:
        blocks_per_request = ceil(per_request / page_size) + 1
        num_blocks = window * job.generation.num_return_sequences * blocks_per_request
        block_bytes = kv_bytes_per_block(loaded.model.config, page_size, loaded.dtype.itemsize)
        available = available_memory_bytes()
        reason = (
            f"{window} requests in flight x {job.generation.num_return_sequences} sequences x {blocks_per_request} "
            f"blocks ({longest_prompt} prompt tokens, the longest of the first {LOOKAHEAD} rows, "
            f"+ {job.generation.max_new_tokens} new)"
        )
        if available and num_blocks * block_bytes > KV_MEMORY_SHARE * available:
            num_blocks = max(blocks_per_request, int(KV_MEMORY_SHARE * available // block_bytes))
            reason += f"; capped at {KV_MEMORY_SHARE:.0%} of available memory"
        batching["num_blocks"] = num_blocks
        sizing.update(chosen_by="cbgen", reason=reason, bytes=num_blocks * block_bytes)
    return batching, window, sizing


def _row(completion: Completion, tokenizer, job: JobConfig) -> dict[str, Any]:
    failed = completion.finish_reason == "error"
    row: dict[str, Any] = {
        "id": completion.request.record.id,
        "sample_index": completion.sample_index,
        "text": None if failed else tokenizer.decode(completion.token_ids, skip_special_tokens=True),
        "token_ids": completion.token_ids,
        "num_prompt_tokens": completion.num_prompt_tokens,
        "num_generated_tokens": len(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "error": completion.error,
    }
    if job.generation.logprobs:
        row["logprobs"] = completion.logprobs or []
    for name in job.input.keep_columns:
        row[name] = completion.request.record.kept.get(name)
    return row


def package_versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "cbgen": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_manifest(summary: RunSummary, job: JobConfig, loaded: LoadedModel | None, batching: dict) -> Path:
    """Writes run.json atomically (temporary name, then rename)."""
    manifest = {
        "cbgen_version": __version__,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "model": {
            "name": summary.model,
            "device": loaded.device if loaded else None,
            "dtype": str(loaded.dtype).removeprefix("torch.") if loaded else None,
            "attn_implementation": loaded.attn_implementation if loaded else None,
        },
        "config": job.to_dict(),
        "continuous_batching": batching,
        "kv_cache": summary.kv_cache,
        "versions": package_versions(),
        "counts": {
            "requests": summary.requests,
            "sequences": summary.sequences,
            "succeeded": summary.succeeded,
            "failed": summary.failed,
            "prompt_tokens": summary.prompt_tokens,
            "generated_tokens": summary.generated_tokens,
        },
        "engine_restarts": summary.engine_restarts,
        "timings": summary.timings,
        "throughput": summary.throughput(),
        "shards": summary.shards,
    }
    path = summary.output_dir / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def run_job(job: JobConfig, progress: ProgressSink | None = None) -> RunSummary:
    """Runs `job` to the end and returns its summary. Raises CbgenError for problems the user can fix."""
    progress = progress or NullProgress()
    started = time.perf_counter()
    if job.input.path is None:
        raise CbgenError("no input file given: cbgen run PROMPTS.jsonl (or - for stdin)")
    reader = open_reader(
        job.input.path,
        prompt_column=job.input.prompt_column,
        id_column=job.input.id_column,
        keep_columns=job.input.keep_columns,
    )
    progress.stage(f"checking {reader.name}")
    reader.check_ids()
    total = reader.count()
    out_dir = Path(job.output.dir)
    prepare_output_dir(out_dir, job.output.overwrite)

    writer = open_writer(
        job.output.format,
        out_dir,
        rows_per_shard=job.output.rows_per_shard,
        logprobs=job.generation.logprobs,
        kept_names=job.input.keep_columns,
        kept_schema=reader.kept_schema,
    )
    with writer:
        progress.stage("loading the model")
        loaded = load_model(job.model)
        summary = RunSummary(output_dir=out_dir, model=loaded.source.name)
        summary.timings["model_load_s"] = round(loaded.load_seconds, 3)
        generation_config, eos = build_generation_config(job, loaded)
        text_config = loaded.model.config.get_text_config()
        max_positions = getattr(text_config, "max_position_embeddings", None)
        renderer = Renderer(loaded.tokenizer, vocab_size=text_config.vocab_size, raw_prompts=job.input.raw_prompts)

        progress.stage("rendering prompts")
        requests = renderer.render_all(reader)
        head: list[Request] = list(itertools.islice(requests, LOOKAHEAD))
        longest = max((len(r.input_ids) for r in head if r.input_ids), default=1)
        batching, window, summary.kv_cache = plan_batching(job, loaded, longest, max_positions)
        cb_config = make_cb_config(batching, job)

        from transformers.generation.continuous_batching.utils import WorkloadHints

        engine = Engine(
            loaded.model,
            generation_config,
            cb_config,
            max_in_flight=window,
            max_new_tokens=job.generation.max_new_tokens,
            num_return_sequences=job.generation.num_return_sequences,
            eos_token_ids=eos,
            max_positions=max_positions,
            workload_hints=WorkloadHints(
                max_prompt_length=longest,
                max_generated_length=job.generation.max_new_tokens,
                num_requests=(total or window) * job.generation.num_return_sequences,
            ),
        )
        ordered = prefix_aware_order(
            itertools.chain(head, requests), key_tokens=batching.get("page_size", 256), lookahead=LOOKAHEAD
        )
        progress.stage("starting the engine")
        progress.start(total * job.generation.num_return_sequences if total is not None else None)
        generation_started = time.perf_counter()
        for completion in engine.run(ordered):
            if completion.sample_index == 0:
                summary.requests += 1
                summary.prompt_tokens += completion.num_prompt_tokens
            summary.sequences += 1
            summary.generated_tokens += len(completion.token_ids)
            failed = completion.finish_reason == "error"
            summary.failed += failed
            summary.succeeded += not failed
            writer.write(_row(completion, loaded.tokenizer, job))
            progress.advance(
                1, completion.num_prompt_tokens if completion.sample_index == 0 else 0, len(completion.token_ids), failed
            )
        summary.timings["generation_s"] = round(time.perf_counter() - generation_started, 3)
    progress.finish()
    summary.shards = [p.name for p in writer.shards]
    summary.engine_restarts = engine.stats.restarts
    summary.kv_cache.update(num_blocks=engine.stats.num_blocks)
    summary.timings["total_s"] = round(time.perf_counter() - started, 3)
    resolved = dict(engine.stats.resolved_config)
    write_manifest(summary, job, loaded, resolved)
    return summary


def make_cb_config(batching: dict[str, Any], job: JobConfig):
    """The ContinuousBatchingConfig: the user's batching fields and cbgen's choices, plus the generation-side ones."""
    from transformers.generation import ContinuousBatchingConfig

    fields = dict(batching)
    fields["return_logprobs"] = job.generation.logprobs
    if job.generation.seed is not None:
        fields["seed"] = job.generation.seed
    try:
        return ContinuousBatchingConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CbgenError(f"batching: {e}") from None
