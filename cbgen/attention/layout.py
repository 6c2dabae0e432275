"""Where each request of a packed continuous-batching step lies in the query and key tensors: what cbgen's attention
functions read from the engine's cumulative lengths (cbgen.attention.per_sequence) and attend by
(cbgen.attention.invariant)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass
class StepLayout:
    """Where each request of a packed batch lies in the query and key tensors (padding sequences left out)."""

    q_starts: list[int]
    q_lengths: list[int]
    k_starts: list[int]
    k_lengths: list[int]
    window: int | None  # sliding window of this layer, as the stock mask applies it, or None
    # the absolute position of each request's first key (0 in a full-attention layer; where the window starts in a
    # sliding one), or None when the engine passed no positions to read it from
    first_positions: list[int] | None = None

    # Derived once per batch: the batch is worked out once per forward pass (pass_memo), its layers all read these

    @cached_property
    def decode(self) -> list[int]:
        """Single-token queries with a past: attended together."""
        return [i for i, (q, k) in enumerate(zip(self.q_lengths, self.k_lengths)) if q == 1 and k > 1]

    @cached_property
    def chunks(self) -> list[int]:
        """Every other query chunk (a one-token prompt's first step included): attended on its own."""
        return [i for i, (q, k) in enumerate(zip(self.q_lengths, self.k_lengths)) if q > 1 or k == 1]

    @cached_property
    def read_end(self) -> int:
        """Rows of the stock packed read-back the batch reads: none when no request has a past (the engine skips the
        read-back then)."""
        return self.k_starts[-1] + self.k_lengths[-1] if self.k_lengths != self.q_lengths else 0

    @cached_property
    def decode_keys(self) -> tuple[list[int], list[int]]:
        """The decode requests' starts and lengths in the packed read-back."""
        return [self.k_starts[i] for i in self.decode], [self.k_lengths[i] for i in self.decode]
