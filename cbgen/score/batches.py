"""Laying rows out for forward passes: each row as one sequence (its choices side by side behind one copy of the
prompt), rows of similar length packed into one padded batch, and the attention that keeps them apart.

A row with choices is one sequence `prompt, choice 1, choice 2, ...`: each choice's tokens take the positions that
follow the prompt and attend to the prompt and to their own choice only, so the prompt is computed once for all of
them and every choice sees exactly what it would see alone. That takes a custom attention mask; where the model
has layers whose attention such a mask cannot describe (anything but full and sliding-window attention), or runs an
attention that takes no custom mask (flash attention: a padding mask only), each choice becomes its own sequence
instead: the same scores, with the prompt computed once per choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cbgen.attention.support import FULL_ATTENTION, SLIDING_ATTENTION, layer_types
from cbgen.score.requests import ScoreRequest


@dataclass
class Piece:
    """One sequence of a batch: tokens, their positions and segments (0: the context, k: continuation k), and the
    scored tokens as (unit, index of the position that predicts it, token id); a unit is a row's completion, its
    text, or one of its choices."""

    row: int  # the request's number in the scorer's window
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    targets: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def branched(self) -> bool:
        """Whether continuations sit side by side (then only a custom mask keeps them apart)."""
        return len(self.segments) > 0 and max(self.segments) > 1


def pieces_of(row: int, request: ScoreRequest, side_by_side: bool) -> list[Piece]:
    """The sequences that score `request`: one, or one per choice when they cannot sit side by side."""
    context = request.context
    if request.scores_context:
        piece = Piece(row, list(context), list(range(len(context))), [0] * len(context))
        piece.targets = [(0, i - 1, token) for i, token in enumerate(context) if i > 0]
        return [piece]
    groups = [list(enumerate(request.continuations))]
    if not side_by_side and len(request.continuations) > 1:
        groups = [[unit] for unit in enumerate(request.continuations)]
    pieces = []
    for units in groups:
        piece = Piece(row, list(context), list(range(len(context))), [0] * len(context))
        for segment, (unit, continuation) in enumerate(units, start=1):
            previous = len(context) - 1  # the first token is predicted from the context's last position
            for offset, token in enumerate(continuation):
                piece.targets.append((unit, previous, token))
                previous = len(piece.ids)
                piece.ids.append(token)
                piece.positions.append(len(context) + offset)
                piece.segments.append(segment)
        pieces.append(piece)
    return pieces


# the attention implementations that apply a custom 4-D additive mask as given (flash attention takes a padding mask
# only, and would let side-by-side choices see each other)
CUSTOM_MASK_ATTENTION = ("sdpa", "eager", None)


@dataclass(frozen=True)
class MaskShape:
    """How a model's layers attend, as far as a custom mask must say: None where a custom mask cannot."""

    types: tuple[str, ...]  # the distinct layer types
    window: int | None  # the sliding window, for sliding layers

    @classmethod
    def of(cls, model: Any) -> MaskShape | None:
        if getattr(model.config, "_attn_implementation", None) not in CUSTOM_MASK_ATTENTION:
            return None  # flash attention reads a 4-D mask as a padding mask: each choice goes alone instead
        config = model.config.get_text_config()
        types = tuple(dict.fromkeys(layer_types(config)))
        if not types or set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
            return None
        window = getattr(config, "sliding_window", None) if SLIDING_ATTENTION in types else None
        if SLIDING_ATTENTION in types and not window:
            return None
        return cls(types, window)


@dataclass
class Batch:
    """The tensors of one forward pass over `pieces` (padded on the right to the longest)."""

    pieces: Sequence[Piece]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | dict[str, Any] | None
    position_ids: torch.Tensor | None
    length: int
    offsets: list[int] | None = None  # packed rows (cbgen.score.packed): where each piece starts in the one sequence
    extra: dict[str, Any] = field(default_factory=dict)  # more keyword arguments of the forward pass

    def flat(self, piece: int, index: int) -> int:
        """Where position `index` of piece number `piece` lies among the pass's hidden states, flattened."""
        return self.offsets[piece] + index if self.offsets is not None else piece * self.length + index

    def forward_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"input_ids": self.input_ids, "use_cache": False, **self.extra}
        if self.attention_mask is not None:
            kwargs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        return kwargs


def make_batch(pieces: Sequence[Piece], shape: MaskShape | None, dtype: torch.dtype, device: torch.device | str
               ) -> Batch:
    """The batch of `pieces`: a padding mask (or none) for plain sequences; the custom mask and positions when
    some piece has continuations side by side (which `shape` then describes)."""
    length = max(len(p.ids) for p in pieces)
    ids = torch.zeros((len(pieces), length), dtype=torch.long)
    valid = torch.zeros((len(pieces), length), dtype=torch.bool)
    for b, piece in enumerate(pieces):
        ids[b, : len(piece.ids)] = torch.tensor(piece.ids)
        valid[b, : len(piece.ids)] = True
    if not any(p.branched for p in pieces):
        padded = not bool(valid.all())
        return Batch(pieces, ids.to(device), valid.long().to(device) if padded else None, None, length)
    assert shape is not None, "continuations side by side need a model a custom mask can describe"
    positions = torch.zeros((len(pieces), length), dtype=torch.long)
    segments = torch.full((len(pieces), length), -1, dtype=torch.long)
    for b, piece in enumerate(pieces):
        positions[b, : len(piece.ids)] = torch.tensor(piece.positions)
        segments[b, : len(piece.ids)] = torch.tensor(piece.segments)
    masks = {kind: _mask(positions, segments, valid, shape.window if kind == SLIDING_ATTENTION else None, dtype)
             for kind in shape.types}
    mask: torch.Tensor | dict[str, torch.Tensor] = (
        next(iter(masks.values())).to(device) if len(masks) == 1 else {k: m.to(device) for k, m in masks.items()})
    return Batch(pieces, ids.to(device), mask, positions.to(device), length)


def _mask(positions: torch.Tensor, segments: torch.Tensor, valid: torch.Tensor, window: int | None,
          dtype: torch.dtype) -> torch.Tensor:
    """(batch, 1, L, L) additive mask: a query sees the keys before it in the context and in its own segment
    (within `window` positions for sliding layers), never padding."""
    index = torch.arange(positions.shape[1])
    causal = index[None, :, None] >= index[None, None, :]
    query_segment, key_segment = segments[:, :, None], segments[:, None, :]
    allowed = causal & ((key_segment == 0) | (key_segment == query_segment)) & valid[:, None, :]
    if window is not None:
        allowed &= (positions[:, :, None] - positions[:, None, :]) < window
    allowed |= ~valid[:, :, None] & (index[None, None, :] == 0)  # a padding query looks at the first key: no NaN
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def plan_batches(pieces: list[Piece], batch_tokens: int) -> list[list[Piece]]:
    """Pieces packed into batches, longest first, each padded to its longest within `batch_tokens` (a piece longer
    than that runs alone)."""
    ordered = sorted(pieces, key=lambda p: -len(p.ids))
    batches: list[list[Piece]] = []
    for piece in ordered:
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0].ids) <= batch_tokens:
            batches[-1].append(piece)
        else:
            batches.append([piece])
    return batches
