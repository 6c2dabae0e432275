"""The sampled draw of the step control (cbgen.control.processor): each row's token drawn by inverse CDF from a
uniform number that is a function of (the request's seed, its sample index, the token's position) alone, over integer
weights whose sums are exact in any order, so a seeded sequence is the same whatever shares its batch. On CPU in
cbgen's compiled kernel (cbgen/kernels/sampling.cpp) where it builds; else, and on a GPU, in torch operators."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch

from cbgen.process.runtime import RUNTIME


def uniform(seed: int, index: int, position: int) -> float:
    """The uniform number in [0, 1) of one token draw: a function of (seed, sample index, position) alone (53 bits
    of a blake2b hash)."""
    digest = hashlib.blake2b(f"{seed}:{index}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / 2**53


WEIGHT_SCALE = 2**44  # a token's weight: floor(exp(score - the row's best) * 2^44), an integer (the best is 2^44)


class DrawBuffers:
    """The eager draw's working memory, kept from step to step: a fresh 25 MB cumulative sum per step (64 rows of
    49,152) cost more in page faults than in arithmetic (measured 5 to 25 ms for the same cumulative sum)."""

    def __init__(self) -> None:
        self.weights = torch.empty(0)
        self.cdf = torch.empty(0, dtype=torch.int64)

    def get(self, rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.weights.shape[0] < rows or self.weights.shape[1:] != (vocab,) or self.weights.device != device:
            self.weights = torch.empty(rows, vocab, device=device)
            self.cdf = torch.empty(rows, vocab, dtype=torch.int64, device=device)
        return self.weights[:rows], self.cdf[:rows]


@RUNTIME.memo("draw kernel", "the compiled sampling kernel (draw, min_p), or why the eager draw runs")
@functools.lru_cache(maxsize=1)
def draw_kernel() -> tuple[Any, str]:
    """(torch.ops.cbgen_kernels with the compiled sampling kernel loaded: the draw and min_p's filter, "compiled")
    or (None, why the eager draw runs)."""
    from cbgen.kernels import kernel

    built = kernel("sampling")
    if not built.loaded:
        return None, f"eager: {built.detail}"
    return torch.ops.cbgen_kernels, "compiled"


def inverse_cdf_draw(scores: torch.Tensor, uniforms: torch.Tensor, buffers: DrawBuffers | None = None,
                     compiled: bool = True) -> torch.Tensor:
    """One token per row of `scores` ([rows, vocab]) drawn from softmax(scores) by its uniform number ([rows],
    float64): the first token whose cumulative weight passes u times the row's total, with integer weights
    floor(exp(score - max) * 2^44) (exact sums, so the order of addition cannot move a draw; a token more than 30.5
    nats below the row's best has weight 0 and is never drawn). A row whose best score is not finite takes its first
    best token (picked on the device by torch.where: nothing waits for it). `compiled`: through cbgen's compiled
    kernel (cbgen/kernels/sampling.cpp) on CPU where it built, one pass per row; else, or on other devices, the
    same arithmetic in torch operators (`buffers`: their working memory to reuse), whose exp may round a last bit
    differently from the kernel's."""
    scores = scores.float()
    if compiled and scores.device.type == "cpu" and (ops := draw_kernel()[0]) is not None:
        rows = scores if scores.stride(-1) == 1 else scores.contiguous()
        return ops.draw_rows(rows, uniforms.to(torch.float64).contiguous())
    weights, cdf = (buffers or DrawBuffers()).get(scores.shape[0], scores.shape[1], scores.device)
    top = scores.amax(dim=-1, keepdim=True)
    torch.sub(scores, top, out=weights).exp_().mul_(WEIGHT_SCALE)
    torch.cumsum(weights.to(torch.int64), dim=-1, out=cdf)  # the float-to-integer conversion truncates
    total = cdf[:, -1:]
    target = (uniforms.to(torch.float64).unsqueeze(1) * total.double()).to(torch.int64)
    target = torch.minimum(target.clamp_(min=0), total - 1)
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=scores.size(1) - 1)
    return torch.where(torch.isfinite(top.squeeze(1)), chosen, _first_best(scores))


def _first_best(scores: torch.Tensor) -> torch.Tensor:
    """The first highest score's index of each row, NaN read as -inf (rows with no finite maximum)."""
    return torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")).argmax(dim=-1)
