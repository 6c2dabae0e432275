"""Soft-capped attention scores under continuous batching.

Models that soft-cap their attention scores (Gemma 2's `attn_logit_softcapping`) have no SDPA attention in
transformers, so continuous batching runs them as `paged|eager`, and in transformers 5.23 that function ignores the
`softcap` argument its callers pass. Scores near the cap then come out different, and so can the tokens: a tiny
Gemma 2 with a cap of 1.0 gave other greedy tokens under continuous batching than under `model.generate`. While the
engine runs such a model, cbgen registers under "paged|eager" the same function with the cap applied where
transformers' own eager attention applies it (`cap * tanh(scores / cap)`, before the mask).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from cbgen.attention import registry, support

PAGED_EAGER = "paged|eager"


def softcap_fix_needed(model: torch.nn.Module) -> bool:
    """Whether the model soft-caps attention scores and will run on transformers' paged eager attention."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "attn_logit_softcapping", None) is None:
        return False
    if support.transformers_version() not in support.VALIDATED_TRANSFORMERS:
        return False
    return getattr(config, "_attn_implementation", None) in ("eager", PAGED_EAGER)


def capped_paged_eager_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float, **kwargs):
    """transformers' `eager_paged_attention_forward`, with the `softcap` its caller passes applied."""
    softcap = kwargs.get("softcap")
    cache = kwargs.get("cache")
    if softcap is None or cache is None:
        return registry.stock(PAGED_EAGER)(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kwargs.pop("cache")
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    if hasattr(module, "sinks"):  # as the stock function handles them
        sinks = module.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        weights = torch.cat([weights, sinks], dim=-1)
        weights = weights - weights.max(dim=-1, keepdim=True).values
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)[..., :-1]
    else:
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


@contextmanager
def softcapped_paged_eager(model: torch.nn.Module) -> Iterator[bool]:
    """Applies the model's attention soft-cap under continuous batching while the block runs, where it is needed;
    yields whether it is installed."""
    if not softcap_fix_needed(model):
        yield False
        return
    with registry.bound(model, PAGED_EAGER, capped_paged_eager_forward):
        yield True
