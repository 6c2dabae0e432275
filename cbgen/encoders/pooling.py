"""Token vectors into one, as sentence-transformers' Pooling module computes them (its float operations in the
same order, so that float32 results agree to rounding)."""

from __future__ import annotations

import torch


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """`hidden` [rows, tokens, dim] with `mask` [rows, tokens] (1 for a row's own tokens, right-padded) pooled by
    `mode` (mean, cls, max, mean_sqrt_len, last), scaled to unit length when `normalize`."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        pooled = hidden[:, 0]
    elif mode == "last":
        last = mask.sum(1) - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    elif mode == "max":
        pooled = hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).max(1).values
    else:
        summed = (hidden * weights).sum(1)
        counts = weights.sum(1).clamp(min=1e-9)
        pooled = summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)
    return torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled
