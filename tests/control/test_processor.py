"""The seeded draw: Gumbel-max with noise from (seed, sample index, position) alone draws exactly from the softmax
of the scores, and the same inputs give the same draw."""

from __future__ import annotations

import math

import torch

from cbgen.control.processor import gumbel_noise

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, float("-inf")])  # the last one is masked


def draw(seed: int, index: int, position: int) -> int:
    return int(torch.argmax(LOGITS + gumbel_noise(seed, index, position, LOGITS.numel())))


def test_draws_follow_the_distribution():
    """Pearson's chi-square over 20,000 draws (seed 1, one draw per position) against softmax(LOGITS): with 6
    degrees of freedom (7 possible tokens), 22.46 is the 0.001 critical value. The draws are a fixed function of
    their seeds, so this either always passes or always fails."""
    draws = 20_000
    counts = torch.bincount(torch.tensor([draw(1, 0, position) for position in range(draws)]), minlength=8)
    assert counts[-1] == 0  # a masked token is never drawn
    expected = torch.softmax(LOGITS, dim=0)[:-1] * draws
    chi_square = float((((counts[:-1] - expected) ** 2) / expected).sum())
    assert chi_square < 22.46, (counts.tolist(), expected.tolist(), chi_square)
    # and not trivially: greedy would put every draw on token 0
    assert counts[0] < 0.6 * draws and all(c > 0 for c in counts[:-1])


def test_a_draw_is_a_function_of_seed_index_and_position_alone():
    assert [draw(7, 0, p) for p in range(50)] == [draw(7, 0, p) for p in range(50)]
    assert [draw(7, 0, p) for p in range(50)] != [draw(7, 1, p) for p in range(50)]  # another sample
    assert [draw(7, 0, p) for p in range(50)] != [draw(8, 0, p) for p in range(50)]  # another seed
    assert math.isfinite(float(gumbel_noise(7, 0, 0, 10).sum()))


def test_bitmask_unpacking_matches_the_bit_layout():
    """Bit j of word w allows token 32 * w + j; a vocabulary that is not a multiple of 32 is cut at its size."""
    from cbgen.control.processor import _blocked

    bits = torch.tensor([[0b101, 0, -1], [-1, -2**31, 1]], dtype=torch.int32)  # 3 words: up to 96 tokens
    blocked = _blocked(bits, 70)
    assert blocked.shape == (2, 70)
    assert blocked[0].logical_not().nonzero().flatten().tolist() == [0, 2, *range(64, 70)]
    assert blocked[1].logical_not().nonzero().flatten().tolist() == [*range(32), 63, 64]
