"""The seeded draw: the inverse-CDF draw with a uniform number from (seed, sample index, position) alone draws exactly
from the softmax of the scores, the same inputs give the same draw, and a row draws the same in any batch."""

from __future__ import annotations

import torch

from cbgen.control.processor import inverse_cdf_draw, uniform

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, float("-inf")])  # the last one is masked


def draw(seed: int, index: int, position: int) -> int:
    return int(inverse_cdf_draw(LOGITS[None], torch.tensor([uniform(seed, index, position)], dtype=torch.float64)))


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
    assert all(0.0 <= uniform(7, 0, p) < 1.0 for p in range(1000))


def test_a_row_draws_the_same_alone_and_in_any_batch():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 49152, generator=generator) * 3
    scores[:, ::7] = float("-inf")  # masked tokens, as top-k, top-p or a grammar leave them
    uniforms = torch.tensor([uniform(5, 0, p) for p in range(64)], dtype=torch.float64)
    together = inverse_cdf_draw(scores, uniforms)
    assert all(int(inverse_cdf_draw(scores[i : i + 1], uniforms[i : i + 1])) == together[i] for i in range(0, 64, 9))
    assert bool((together % 7 != 0).all())  # never a masked token
    # a uniform number at the very top still lands on a token that can be drawn
    last = torch.full((1, 8), float("-inf"))
    last[0, 2] = 0.0
    assert int(inverse_cdf_draw(last, torch.tensor([1 - 2**-53], dtype=torch.float64))) == 2


def test_bitmask_unpacking_matches_the_bit_layout():
    """Bit j of word w allows token 32 * w + j; a vocabulary that is not a multiple of 32 is cut at its size."""
    from cbgen.control.processor import _blocked

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
    from cbgen.outputs import read_shards
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
