"""One loaded model used to generate, then score, then generate again (a Generator, and lm-eval's backend on it).
transformers issue 48735: while a continuous-batching manager is alive, a plain forward on the same model fails.
cbgen's engine scope stops its manager and takes its attention and kernels out when a call ends, so the next call,
a plain forward included, sees the stock model: each result equals what a freshly loaded model gives."""

from __future__ import annotations

import torch
from lm_eval.api.instance import Instance

from cbgen.evaluation.lm import CbgenLM

PAIRS = [("The capital of France is", " Paris"), ("Two plus two is", " four")]
ASK = ("Once upon a time", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False})


def _scores(lm: CbgenLM) -> list[tuple[float, bool]]:
    return lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)])


def _generate(lm: CbgenLM) -> list[str]:
    return lm.generate_until([Instance("generate_until", {}, ASK, 0)])


def test_generate_then_score_then_generate_on_one_model(tiny_model_dir):
    fresh_scores = _scores(CbgenLM(model=str(tiny_model_dir), dtype="float32"))
    fresh_text = _generate(CbgenLM(model=str(tiny_model_dir), dtype="float32"))
    lm = CbgenLM(model=str(tiny_model_dir), dtype="float32")
    assert _generate(lm) == fresh_text
    assert _scores(lm) == fresh_scores  # scoring after generating: the same numbers, bit for bit
    assert _generate(lm) == fresh_text
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    model = lm.generator.loaded.model
    with torch.no_grad():
        after = model(ids).logits  # a plain forward on the model a manager ran on
    reference = CbgenLM(model=str(tiny_model_dir), dtype="float32").generator.loaded.model
    with torch.no_grad():
        assert torch.equal(after, reference(ids).logits)
    results = lm.generator.generate(["Hi"], max_new_tokens=3)  # the Generator itself, once more
    assert len(results) == 1 and results[0].error is None
