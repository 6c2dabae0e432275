"""Scoring with rows packed end to end through cbgen's compiled attention (cbgen.attention.packed), the default where
the kernel serves the model: each scored token's logprob equals an independent forward pass (float32, 1e-4) for
every architecture family the kernel serves, with choices side by side behind one prompt; a row's scores are the
same bits whatever rows share its passes and in whatever order (float32 and bfloat16), and the check sees rows that
attend across each other; the plan packs rows only where the kernel serves the model."""

from __future__ import annotations

import threading

import pytest
import torch

from cbgen.engine.scope import PACKED_ROWS, ScopePlan
from cbgen.model.linear import TILES
from cbgen.score import packed as packed_module
from cbgen.score.scorer import Scorer
from tests.model.test_architectures import ARCHITECTURES
from tests.score.test_scorer import _model, _requests, _score, check_against_forward

SCOPE = ScopePlan(attention=PACKED_ROWS, batch_invariant=True, linear=TILES)
SERVED = [name for name, (_, attention) in ARCHITECTURES.items() if attention.startswith("per-sequence, compiled")]


@pytest.mark.parametrize("name", SERVED)
def test_each_token_logprob_equals_an_independent_forward(name):
    model = _model(name, vocab_size=1024)
    requests = _requests(seed=1)
    check_against_forward(model, requests, _score(model, requests, scope=SCOPE, top_logprobs=3), name, top_logprobs=3)


def _bits(results) -> dict[str, object]:
    return {key: (r.logprobs, r.score.choice_logprobs, r.score.logprob) for key, r in results.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_scores_are_its_own_bits_in_any_pass(dtype):
    model = _model("mistral", vocab_size=1024).to(dtype)  # sliding windows of 16: rows longer than them
    requests = _requests(seed=2, count=12)
    together = _score(model, requests, scope=SCOPE, batch_tokens=4096)
    apart = _score(model, requests[::-1], scope=SCOPE, batch_tokens=40)
    assert _bits(together) == _bits(apart)
    scorer = Scorer(model, batch_tokens=40, scope=SCOPE)
    list(scorer.run(iter(requests), threading.Event()))
    assert scorer.stats.forward_passes > 6 and scorer.stats.padded_tokens == scorer.stats.tokens  # no padding


def test_the_check_sees_rows_that_attend_across_each_other(monkeypatch):
    """Without the request table the pass is one sequence: later rows attend to earlier ones, and their scores
    move, which the equality above would catch."""
    model = _model("llama", vocab_size=1024)
    requests = _requests(seed=4, count=6)
    alone = _score(model, requests, scope=SCOPE, batch_tokens=1)
    real = packed_module.make_packed

    def merged(pieces, device):
        batch = real(pieces, device)
        requests_table, read = batch.extra[packed_module.PACKED_KWARG]
        total = batch.input_ids.shape[1]
        batch.extra[packed_module.PACKED_KWARG] = (torch.tensor([[0, total, 0, total, 0]]), read[:0])
        return batch

    monkeypatch.setattr("cbgen.score.scorer.make_packed", merged)
    leaking = _score(model, requests, scope=SCOPE, batch_tokens=4096)
    assert _bits(leaking) != _bits(alone)


def test_the_plan_packs_rows_where_the_kernel_serves(tiny_model_dir):
    from cbgen.config import ModelSection, build_config
    from cbgen.config.flat import flat_overrides
    from cbgen.engine.setup import plan_scoring_scope
    from cbgen.model.load import load_model

    loaded = load_model(ModelSection(model=str(tiny_model_dir), dtype="float32"))

    def scope(**settings):
        return plan_scoring_scope(build_config(None, flat_overrides(settings), kind="score"), loaded)

    default = scope()
    assert default.attention == PACKED_ROWS and default.batch_invariant and default.linear == TILES
    assert scope(batch_invariant=False).attention == "stock"
    alone = scope(compiled_attention=False, batch_invariant=True)
    assert alone.attention == "stock" and alone.batch_invariant  # each row alone: the old invariant path
