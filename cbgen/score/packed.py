"""Rows packed end to end into one sequence per forward pass, for cbgen's compiled attention over packed rows
(cbgen.attention.packed): no padding and no mask, the kernel's request table saying who attends what.

A piece (cbgen.score.batches) of a plain row is one request over its own tokens. A piece whose continuations sit
side by side behind its context is one request for the context and one per continuation: a continuation's request
reads the context's keys (their places among the pass's tokens) and then its own, at the positions that follow the
context, which is what the custom mask of a padded batch allows it. Pieces are taken in order until the next would
pass `batch_tokens` (a piece longer than that runs alone).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cbgen.attention.packed import PACKED_KWARG
from cbgen.score.batches import Batch, Piece

# what the model is given as its mask: a 4D tensor, which transformers takes as a mask already made and so builds
# none ([tokens, tokens] over a whole packed pass); the packed attention never reads it
_NO_MASK = torch.zeros(1, 1, 1, 1, dtype=torch.bool)


def plan_packed(pieces: list[Piece], batch_tokens: int) -> list[list[Piece]]:
    batches: list[list[Piece]] = []
    used = 0
    for piece in pieces:
        if batches and used + len(piece.ids) <= batch_tokens:
            batches[-1].append(piece)
            used += len(piece.ids)
        else:
            batches.append([piece])
            used = len(piece.ids)
    return batches


def _requests(piece: Piece, offset: int, read: list[int]) -> list[tuple[int, int, int, int, int]]:
    """The kernel's requests (q_start, q_length, k_start, k_length, first_position) of a piece starting at `offset`;
    the context's places for its continuations are appended to `read`."""
    if not piece.branched:
        return [(offset, len(piece.ids), 0, len(piece.ids), 0)]
    context = piece.segments.index(1)
    found = [(offset, context, 0, context, 0)]
    start = context
    while start < len(piece.ids):
        end = start
        while end < len(piece.ids) and piece.segments[end] == piece.segments[start]:
            end += 1
        found.append((offset + start, end - start, len(read), context + end - start, 0))
        read.extend(range(offset, offset + context))
        start = end
    return found


def make_packed(pieces: Sequence[Piece], device: torch.device | str) -> Batch:
    """The forward pass of `pieces` packed end to end: [1, tokens] ids and positions, no mask, and the kernel's
    request table."""
    offsets: list[int] = []
    ids: list[int] = []
    positions: list[int] = []
    requests: list[tuple[int, int, int, int, int]] = []
    read: list[int] = []
    for piece in pieces:
        offsets.append(len(ids))
        requests += _requests(piece, len(ids), read)
        ids += piece.ids
        positions += piece.positions
    layout = (torch.tensor(requests, dtype=torch.int64), torch.tensor(read, dtype=torch.int64))
    return Batch(pieces, torch.tensor([ids], device=device), _NO_MASK, torch.tensor([positions], device=device),
                 len(ids), offsets, {PACKED_KWARG: layout})
