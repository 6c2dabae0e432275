"""The seeded draw: the inverse-CDF draw with a uniform number from (seed, sample index, position) alone draws exactly
from the softmax of the scores, the same inputs give the same draw, and a row draws the same in any batch; the
compiled draw (cbgen/kernels/sampling.cpp) and its eager twin agree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.control.draw import WEIGHT_SCALE, draw_kernel, inverse_cdf_draw, uniform
from tests.helpers import property_examples

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, float("-inf")])  # the last one is masked
DRAWS = [pytest.param(True, id="compiled"), pytest.param(False, id="eager")]


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    """The compiled draw is built here (a machine with a compiler): its tests must not pass on the eager twin."""
    assert draw_kernel()[0] is not None, draw_kernel()[1]


def draw(seed: int, index: int, position: int, compiled: bool = True) -> int:
    return int(inverse_cdf_draw(LOGITS[None], torch.tensor([uniform(seed, index, position)], dtype=torch.float64),
                                compiled=compiled))


@pytest.mark.parametrize("compiled", DRAWS)
def test_draws_follow_the_distribution(compiled):
    """Pearson's chi-square over 20,000 draws (seed 1, one draw per position) against softmax(LOGITS): with 6
    degrees of freedom (7 possible tokens), 22.46 is the 0.001 critical value. The draws are a fixed function of
    their seeds, so this either always passes or always fails."""
    draws = 20_000
    uniforms = torch.tensor([uniform(1, 0, position) for position in range(draws)], dtype=torch.float64)
    chosen = inverse_cdf_draw(LOGITS.expand(draws, -1), uniforms, compiled=compiled)
    counts = torch.bincount(chosen, minlength=8)
    assert counts[-1] == 0  # a masked token is never drawn
    expected = torch.softmax(LOGITS, dim=0)[:-1] * draws
    chi_square = float((((counts[:-1] - expected) ** 2) / expected).sum())
    assert chi_square < 22.46, (counts.tolist(), expected.tolist(), chi_square)
    # and not trivially: greedy would put every draw on token 0
    assert counts[0] < 0.6 * draws and all(c > 0 for c in counts[:-1])
    assert chosen[:50].tolist() == [draw(1, 0, p, compiled) for p in range(50)]  # a row alone draws the same


@pytest.mark.parametrize("compiled", DRAWS)
def test_a_draw_is_a_function_of_seed_index_and_position_alone(compiled):
    assert [draw(7, 0, p, compiled) for p in range(50)] == [draw(7, 0, p, compiled) for p in range(50)]
    assert [draw(7, 0, p, compiled) for p in range(50)] != [draw(7, 1, p, compiled) for p in range(50)]  # sample
    assert [draw(7, 0, p, compiled) for p in range(50)] != [draw(8, 0, p, compiled) for p in range(50)]  # seed
    assert all(0.0 <= uniform(7, 0, p) < 1.0 for p in range(1000))


@pytest.mark.parametrize("compiled", DRAWS)
def test_a_row_draws_the_same_alone_and_in_any_batch(compiled):
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 49152, generator=generator) * 3
    scores[:, ::7] = float("-inf")  # masked tokens, as top-k, top-p or a grammar leave them
    uniforms = torch.tensor([uniform(5, 0, p) for p in range(64)], dtype=torch.float64)
    together = inverse_cdf_draw(scores, uniforms, compiled=compiled)
    assert all(int(inverse_cdf_draw(scores[i : i + 1], uniforms[i : i + 1], compiled=compiled)) == together[i]
               for i in range(0, 64, 9))
    assert bool((together % 7 != 0).all())  # never a masked token
    # a uniform number at the very top still lands on a token that can be drawn
    last = torch.full((1, 8), float("-inf"))
    last[0, 2] = 0.0
    assert int(inverse_cdf_draw(last, torch.tensor([1 - 2**-53], dtype=torch.float64), compiled=compiled)) == 2
    # rows nothing can be drawn from by weight take their first best token: every token masked, +inf, NaN
    odd = torch.tensor([[float("-inf")] * 4, [0.0, float("inf"), 1.0, float("inf")], [float("nan"), 1.0, 3.0, 3.0]])
    assert inverse_cdf_draw(odd, torch.full((3,), 0.5, dtype=torch.float64), compiled=compiled).tolist() == [0, 1, 2]


def _eager_cdf(row: torch.Tensor) -> torch.Tensor:
    weights = (row.float() - row.float().max()).exp() * WEIGHT_SCALE
    return torch.cumsum(weights.to(torch.int64), dim=0)


@settings(max_examples=property_examples(60), deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(1, 3000), spread=st.floats(0.1, 30.0), masked=st.integers(0, 5),
       seed=st.integers(0, 2**31))
def test_the_compiled_draw_is_the_eager_draw(rows, vocab, spread, masked, seed):
    """Over random shapes and scores (vocabularies not a multiple of any vector width, masked tokens, flat and peaked
    rows), the kernel draws each row's token where the eager draw's cumulative weights put it. The two round exp
    each in their own way (ATen's vector exp against torch's operator, whose last elements may take the scalar exp),
    so a row may differ only where its target lies within those roundings of a token's boundary: each such row is
    checked to be one."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=generator) * spread
    if masked:
        scores[:, ::masked + 1] = float("-inf")
    scores[:, 0] = torch.where(torch.isinf(scores[:, 0]), torch.zeros(rows), scores[:, 0])  # a token to draw
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    compiled = inverse_cdf_draw(scores, uniforms, compiled=True)
    eager = inverse_cdf_draw(scores, uniforms, compiled=False)
    for i in (compiled != eager).nonzero().flatten().tolist():
        cdf = _eager_cdf(scores[i])
        target = int(uniforms[i] * float(cdf[-1]))
        # one ulp of a weight is at most 2^(44 - 24) at the integer scale; a few tokens' roundings apart at most
        boundary = int(cdf[min(int(compiled[i]), int(eager[i]))])
        assert abs(boundary - target) <= 64 * 2**20, (i, int(compiled[i]), int(eager[i]))
    assert (compiled != eager).float().mean() <= 0.05
    assert bool(torch.isfinite(scores.gather(1, compiled[:, None])).all())  # never a masked token


def test_bitmask_unpacking_matches_the_bit_layout():
    """Bit j of word w allows token 32 * w + j; a vocabulary that is not a multiple of 32 is cut at its size."""
    from cbgen.control.bitmask import _blocked

    bits = torch.tensor([[0b101, 0, -1], [-1, -2**31, 1]], dtype=torch.int32)  # 3 words: up to 96 tokens
    blocked = _blocked(bits, 70)
    assert blocked.shape == (2, 70)
    assert blocked[0].logical_not().nonzero().flatten().tolist() == [0, 2, *range(64, 70)]
    assert blocked[1].logical_not().nonzero().flatten().tolist() == [*range(32), 63, 64]


def test_cbgen_draws_an_unseeded_sampled_job_itself_on_cpu(tiny_model_dir, tmp_path):
    """An unseeded sampled job on CPU runs through the step control's draw (transformers' own, a softmax and
    torch.multinomial over the vocabulary, was most of a sampled step), and the manager's runner takes the argmax of
    the one token it leaves."""
    import json
    from types import SimpleNamespace

    from cbgen.cli import run_cli
    from cbgen.control.processor import StepControl, take_over_sampling
    from cbgen.rows import read_shards
    from tests.helpers import write_jsonl

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": f"Say {i}."} for i in range(4)])
    out = tmp_path / "out"
    assert run_cli(["run", str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--temperature", "0.9",
                    "--max-new-tokens", "6", "-q"]) == 0
    assert json.loads((out / "run.json").read_text())["step_control"]["draws"] == "per request"
    assert len(list(read_shards(out))) == 4

    manager = SimpleNamespace(batch_processor=SimpleNamespace(model_runner=SimpleNamespace(do_sample=True)))
    sampled = StepControl(vocab_size=8, grammars=None, do_sample=True, capture=False, top_logprobs=0)
    take_over_sampling(manager, sampled)
    assert manager.batch_processor.model_runner.do_sample is False
