"""Grammar masks applied to the logits on their device: llguidance fills each row's allowed tokens on the host as
packed bits (a 32-bit word per 32 tokens), the step control copies them packed and only for the rows that follow a
format, and they are unpacked here (by llguidance's own torch helper on a GPU)."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_helper_failed = False  # llguidance's helper raised once (no Triton, a compile error): the eager unpack serves


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Masks, in place, the tokens `bitmask` ([rows, words] int32, on the logits' device: bit j of word w allows
    token 32 * w + j) does not allow in `logits` ([rows, vocab]); tokens past the bitmask's words are not allowed.
    On a GPU through llguidance's own helper (llguidance.torch.apply_token_bitmask_inplace: one kernel torch.compile
    builds once per process; the same masking, checked by tests/control/test_transfers.py); elsewhere, or where
    the helper fails, `_apply_bitmask` in eager torch operators: on a CPU the helper's torch.compile is a C++ build
    of 15 s or more per process on 2 cores (again for each new vocabulary width), where a step takes milliseconds."""
    global _helper_failed
    if logits.device.type == "cuda" and not _helper_failed:
        from llguidance.torch import apply_token_bitmask_inplace

        try:
            apply_token_bitmask_inplace(logits, bitmask)
            return
        except Exception as e:  # torch.compile's failures come as many kinds of exception
            _helper_failed = True
            log.warning("llguidance's torch helper failed (%s): grammar masks are unpacked by torch operators",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
    _apply_bitmask(logits, bitmask)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """`apply_bitmask` in eager torch operators, on any device: tokens past the bitmask's words are masked as
    llguidance's helper masks them, the rest by their bits."""
    bits = 32 * bitmask.size(1)
    if logits.size(1) > bits:
        logits[:, bits:] = float("-inf")
        logits = logits[:, :bits]
    logits.masked_fill_(_blocked(bitmask, logits.size(1)), float("-inf"))


def _blocked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit j of word w allows token 32 * w + j) -> [rows, vocab] bool, True where the
    token is not allowed (tokens past the words' 32 * words too), on the bitmask's device. The words are read as
    little-endian bytes (every device torch runs on), each byte's 8 bits unpacked by one broadcast shift: a byte per
    token, where shifting the int32 words would write four."""
    rows, words = bitmask.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    not_allowed = bitmask.contiguous().view(torch.uint8).bitwise_not().unsqueeze(-1).bitwise_right_shift(shifts)
    blocked = not_allowed.bitwise_and_(1).view(rows, 32 * words)
    if vocab > 32 * words:
        blocked = torch.cat([blocked, blocked.new_ones(rows, vocab - 32 * words)], dim=1)
    return blocked[:, :vocab].view(torch.bool)
