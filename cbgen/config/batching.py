"""The `batching` section: transformers' `ContinuousBatchingConfig`, field for field, with cbgen's own help texts.

The table is written out here rather than read from the installed class, so that commands which load no model (help,
`config show`, `config init`) never import transformers. `tests/config/test_batching.py` checks it against the
installed class: every field, its default, nothing missing and nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchingField:
    type: Any  # the annotation values are checked against (cbgen.config.values)
    default: Any  # transformers' own default
    help: str


BATCHING_FIELDS: dict[str, BatchingField] = {
    "page_size": BatchingField(
        int, 256, "Tokens per KV-cache page (at least 4). Smaller pages waste less memory on short requests; larger "
        "ones mean less bookkeeping."),
    "num_blocks": BatchingField(
        int | None, None, "KV-cache size in blocks of page_size tokens. Default: on CPU, sized by cbgen for the "
        "requests it keeps in flight; on GPU, from free memory."),
    "max_batch_tokens": BatchingField(
        int | None, None, "Token budget of one forward pass; longer prompts are prefilled in chunks. Default: on CPU, "
        "from the CPU-kind table (docs/model.md, 'Defaults by CPU'); on GPU, from free memory."),
    "max_memory_percent": BatchingField(
        float | None, None, "Size the KV cache as this share (0-1] of free device memory instead (on CPU: of system "
        "RAM, which is rarely what you want)."),
    "max_requests_per_batch": BatchingField(
        int | None, None, "Most requests in one forward pass. Default: on CPU, from the CPU-kind table (docs/model.md, "
        "'Defaults by CPU'; smaller with the stock attention); on GPU, from the workload."),
    "max_blocks_per_request": BatchingField(
        int | None, None, "Width of the block table of the flash decode fast path (GPU); 0 turns that path off. "
        "Default: inferred."),
    "allow_block_sharing": BatchingField(
        bool, True, "Reuse the KV blocks of shared prompt prefixes. It can only be allowed: models with "
        "sliding-window layers turn it off."),
    "use_async_batching": BatchingField(
        bool | None, None, "Prepare the next batch on the CPU while the GPU computes this one (needs CUDA graphs, "
        "doubles the cache memory). Default: decided by transformers."),
    "use_cuda_graph": BatchingField(
        bool | tuple[bool, bool] | None, None, "Record and replay CUDA graphs (GPU only): true, false, or a pair "
        "[prefill path, decode path]. Default: decided by transformers."),
    "q_padding_interval_size": BatchingField(
        int, 0, "CUDA-graph padding step for query lengths, in tokens; 0 takes transformers' preset."),
    "kv_padding_interval_size": BatchingField(
        int, 0, "CUDA-graph padding step for key/value lengths, in tokens; 0 takes transformers' preset."),
    "varlen_compile_config": BatchingField(
        dict | None, None, "torch.compile settings for the prefill (varying-length) path, as a mapping of "
        "CompileConfig fields, e.g. {mode: default, dynamic: true}."),
    "decode_compile_config": BatchingField(
        dict | None, None, "torch.compile settings for the decode path, as a mapping of CompileConfig fields."),
    "default_compile_level": BatchingField(
        int, 0, "torch.compile level 0-3 for the paths without compile settings: higher runs faster after a longer "
        "warm-up. 0 compiles nothing."),
    "scheduler_type": BatchingField(
        str, "fifo", "fifo admits requests in order and keeps a safety margin of free cache; prefill_first favours "
        "starting new requests."),
    "safety_margin": BatchingField(
        float | None, None, "Share [0-1] of the cache kept free for running requests before new ones are admitted "
        "(fifo: 0.15, prefill_first: 0)."),
    "auto_switch_to_flash": BatchingField(
        bool, True, "Run sdpa or eager models with flash attention when it is installed (GPU)."),
    "cpu_offload_space": BatchingField(
        float | None, 0.0, "GiB of host memory to swap evicted KV blocks into instead of recomputing them (GPU)."),
    "cpu_offload_space_safety_threshold": BatchingField(
        float, 0.8, "cpu_offload_space is capped at this share of system RAM."),
    "max_queue_size": BatchingField(
        int, 0, "Most requests waiting in the engine's queue; 0 = unlimited (cbgen bounds what it hands over with "
        "run.max_in_flight)."),
    "per_request_processors": BatchingField(
        bool, False, "Let each request carry its own temperature, top_p and top_k. cbgen turns it on when rows "
        "carry their own."),
    "drop_unsupported_processors": BatchingField(
        bool, True, "Drop, with a warning, logits processors that continuous batching cannot apply, instead of "
        "failing."),
    "disable_nccl_graph_mixing": BatchingField(
        bool, True, "Tensor parallel on GPUs: turn off NCCL's guard for CUDA graphs that communicate (continuous "
        "batching never needs it, and it costs speed)."),
    "cpu_group_timeout": BatchingField(
        float | None, 300.0, "Seconds a tensor-parallel CPU collective may wait before the process fails."),
}

# ContinuousBatchingConfig fields that cbgen sets from another section, or that transformers has deprecated.
BATCHING_REDIRECTS: dict[str, str] = {
    "return_logprobs": "set generation.logprobs (or --logprobs) instead",
    "seed": "set generation.seed (or --seed) instead",
    "block_size": "deprecated in transformers: use batching.page_size",
    "use_default_compile_configs": "deprecated in transformers: use batching.default_compile_level",
    "max_cached_graphs": "deprecated in transformers and ignored: remove it",
}

SCHEDULERS = ("fifo", "prefill_first")
PAGE_SIZE = BATCHING_FIELDS["page_size"].default  # the engine's page size when the job sets none


def page_size(batching: dict[str, Any]) -> int:
    """The page size a job's batching section gives the engine."""
    return batching.get("page_size", PAGE_SIZE)
