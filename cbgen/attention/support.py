"""Where cbgen's attention functions apply: the transformers versions they were checked against, and the models they
support (their installation: cbgen.attention.registry)."""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import torch

VALIDATED_TRANSFORMERS: tuple[tuple[int, int], ...] = ((5, 23),)
"""transformers (major, minor) versions whose continuous-batching argument layout this module was checked against."""

logger = logging.getLogger(__name__)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@lru_cache(maxsize=8)
def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string, or None when it cannot be read."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return (release[0], release[1]) if len(release) >= 2 else None


def transformers_version() -> tuple[int, int] | None:
    import transformers

    return _release(transformers.__version__)


def paged_cache_class() -> type | None:
    """The engine's cache class, or None when this transformers version is not one we validated."""
    if transformers_version() not in VALIDATED_TRANSFORMERS:
        return None
    try:
        from transformers.generation.continuous_batching import PagedAttentionCache
    except ImportError:
        return None
    return PagedAttentionCache


def layer_types(config: Any) -> list[str]:
    """The attention type of each layer, as the engine's cache groups them (one KV layout per type)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    attention_type = SLIDING_ATTENTION if getattr(config, "sliding_window", None) is not None else FULL_ATTENTION
    return [attention_type] * int(getattr(config, "num_hidden_layers", 0) or 0)


def cpu_attention_unavailable_reason(model: torch.nn.Module) -> str | None:
    """Why `per_sequence_attention(model)` would leave the stock attention in place, or None when it applies."""
    version = transformers_version()
    if version not in VALIDATED_TRANSFORMERS:
        import transformers

        validated = ", ".join(f"{major}.{minor}" for major, minor in VALIDATED_TRANSFORMERS)
        return f"transformers {transformers.__version__} is not a validated version ({validated})"
    if paged_cache_class() is None:
        return "transformers has no continuous-batching PagedAttentionCache"
    if (_release(torch.__version__) or (0, 0)) < (2, 5):
        return f"torch {torch.__version__} predates enable_gqa in scaled_dot_product_attention (needs 2.5)"
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"the model uses attn_implementation={getattr(config, '_attn_implementation', None)!r}, not 'sdpa'"
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return "the model has no parameters"
    if device.type not in ("cpu", "meta"):  # meta: a model without weights, planning a CPU job (a dry run)
        return f"the model is on {device.type}, and the per-sequence attention is for CPU"
    unknown = sorted(set(layer_types(config)) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        return f"the model has attention types {unknown} that only the stock attention handles"
    for name in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"the model soft-caps attention logits ({name})"
    return None


def cpu_attention_available(model: torch.nn.Module) -> bool:
    """True when `per_sequence_attention(model)` would install the per-sequence attention for this model."""
    return cpu_attention_unavailable_reason(model) is None
