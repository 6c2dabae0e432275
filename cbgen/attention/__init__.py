"""Per-sequence attention for transformers' continuous batching on CPU.

What: an attention function for the continuous-batching engine (`ContinuousBatchingManager`, `generate_batch`) that
attends each request only to its own keys: all single-token queries of a step (decode) as one batched SDPA over each
request's own KV, padded to the longest with a key mask, and every longer query chunk (prefill, chunked prefill) as
one causal SDPA of its own. Grouped-query heads are never copied: decode folds the query heads onto their KV head and
prefill uses `enable_gqa=True`.

Why: on CPU the engine runs as `paged|sdpa`, whose attention scores the whole packed batch against the keys of every
request with one dense mask: a decode step of P requests of length L costs O(P²·L) and discards (P-1)/P of it, and
GQA is expanded with `repeat_kv`. That attention was 70% of a decode step at 64 sequences (torch.profiler on a
2-core CPU, the embedded model in bf16: ~367 ms a step).

Three functions serve it: the compiled kernel (cbgen.attention.compiled: the whole step in one C++ call per layer,
reading the paged cache in place, batch-invariant by construction), used wherever it builds and fits the model; and,
where it does not, the eager per-sequence path below or its batch-invariant variant (cbgen.attention.invariant).

How it is selected: the engine accepts only `sdpa`, `paged|eager` or flash names, so the function is bound under
`"sdpa"` for one model, through the public `transformers.AttentionInterface`, inside `per_sequence_attention(model)`
(cbgen.attention.registry: the name routes each call by its model, so other models keep their own attention). For the
model it serves, it hands each call that it was not built for to the stock function unchanged: calls without a paged
cache (plain `model.generate`), other devices, training (dropout), torch.compile tracing, soft-capping, position bias,
attention sinks or any keyword argument it does not know, attention types other than full and sliding-window, and
batches whose lengths do not match the layout it expects. It relies on the engine's argument layout, which is checked
against the transformers versions in `support.VALIDATED_TRANSFORMERS`; with any other version it never installs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cbgen.attention.compiled import KERNEL, compiled_attention_unavailable_reason, compiled_sdpa_forward
from cbgen.attention.pass_memo import watch
from cbgen.attention.per_sequence import batch_invariant_sdpa_forward, per_sequence_sdpa_forward
from cbgen.attention.registry import bound
from cbgen.attention.support import cpu_attention_available, cpu_attention_unavailable_reason

__all__ = ["batch_invariant_sdpa_forward", "compiled_attention_unavailable_reason", "compiled_sdpa_forward",
           "cpu_attention_available", "cpu_attention_unavailable_reason", "per_sequence_attention",
           "per_sequence_sdpa_forward"]

logger = logging.getLogger(__name__)


@contextmanager
def per_sequence_attention(model: torch.nn.Module, *, required: bool = False, invariant: bool = False,
                           compiled: bool = False) -> Iterator[bool]:
    """Serves the model's continuous-batching attention per sequence while the block runs; yields whether it does.

    Enter it around the whole life of a `ContinuousBatchingManager` (its generation thread looks the attention
    function up at every forward pass); on exit the model attends as before. When the model is not supported (see
    `cpu_attention_unavailable_reason`), nothing is installed and the block runs on the stock attention; with
    `required=True` that raises `RuntimeError` instead. `invariant`: every token attended batch-invariantly
    (cbgen.attention.invariant). `compiled`: the whole step in cbgen's compiled kernel (cbgen.attention.compiled),
    invariant by construction; the caller has checked that it loaded. Another engine holding the same model with
    another function raises CbgenError.
    """
    reason = cpu_attention_unavailable_reason(model)
    if reason is not None:
        if required:
            raise RuntimeError(f"per-sequence attention is not available: {reason}")
        logger.info("per-sequence attention not used: %s", reason)
        yield False
        return
    if compiled:  # loaded in this process (a replica process planned by its parent has not loaded it yet)
        from cbgen.kernels import kernel

        built = kernel(KERNEL)
        if not built.loaded:
            raise RuntimeError(f"cbgen's compiled attention is not available: {built.detail}")
    function = compiled_sdpa_forward if compiled else (
        batch_invariant_sdpa_forward if invariant else per_sequence_sdpa_forward)
    with bound(model, "sdpa", function):
        unwatch = watch(model)
        try:
            yield True
        finally:
            unwatch()
