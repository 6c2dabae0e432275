"""The scorer's logprobs are the model's own: each scored token's logprob equals an independent forward pass of the
model over the whole sequence (float32, within 1e-4), for every architecture family cbgen expects, whatever rows
share a batch, with choices side by side behind one prompt, and with the logits worked in bounded chunks."""

from __future__ import annotations

import threading

import pytest
import torch

from cbgen.records import PromptRecord, Request, ScoreTarget
from cbgen.score import head as head_module
from cbgen.score.requests import ScoreRequest
from cbgen.score.scorer import Scorer
from tests.model.test_architectures import ARCHITECTURES, BASE

TOLERANCE = 1e-4


def _model(name: str, vocab_size: int, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs, _ = ARCHITECTURES[name]
    config = AutoConfig.for_model(**{**BASE, "vocab_size": vocab_size, **kwargs, **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _ids(generator: torch.Generator, low: int, high: int) -> list[int]:
    length = int(torch.randint(low, high, (1,), generator=generator))
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


def _requests(seed: int, count: int = 9) -> list[ScoreRequest]:
    """Texts, completions and rows of four choices, of mixed lengths (longer than the 16-token sliding windows)."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(count):
        context = _ids(generator, 5, 70)
        if i % 3 == 0:
            target, continuations = ScoreTarget(text="t"), ()
        elif i % 3 == 1:
            target, continuations = ScoreTarget(completion="c"), (tuple(_ids(generator, 1, 30)),)
        else:
            target = ScoreTarget(choices=("a", "b", "c", "d"))
            continuations = tuple(tuple(_ids(generator, 1, 25)) for _ in range(4))
        record = PromptRecord(id=str(i), index=i, location=f"rows.jsonl:{i + 1}", target=target)
        requests.append(ScoreRequest(Request(record, input_ids=context), continuations))
    return requests


def _score(model, requests: list[ScoreRequest], **kwargs) -> dict[str, object]:
    scorer = Scorer(model, **{"batch_tokens": 256, **kwargs})
    results = {}
    for group in scorer.run(iter(requests), threading.Event()):
        assert len(group) == 1 and group[0].error is None, group[0].error
        results[group[0].request.record.id] = group[0]
    assert len(results) == len(requests)
    return results


@torch.inference_mode()
def _reference(model, sequence: list[int], start: int) -> tuple[list[float], torch.Tensor]:
    """Each token's logprob from one forward pass of the model over the whole sequence, from `start` on, and the
    log-softmax rows that predicted them."""
    logprobs = model(input_ids=torch.tensor([sequence])).logits[0].float().log_softmax(-1)
    return [float(logprobs[p - 1, sequence[p]]) for p in range(start, len(sequence))], logprobs[start - 1:-1]


def check_against_forward(model, requests: list[ScoreRequest], results: dict[str, object], name: str,
                          top_logprobs: int = 0) -> None:
    """Each scored token's logprob (and its top alternatives) equals an independent forward pass's."""
    for request in requests:
        result = results[request.request.record.id]
        context = request.context
        if request.has_choices:
            for k, choice in enumerate(request.continuations):
                expected, _ = _reference(model, context + list(choice), len(context))
                assert result.score.choice_logprobs[k] == pytest.approx(sum(expected), abs=TOLERANCE), (name, k)
                assert result.score.choice_tokens[k] == len(choice)
            continue
        sequence = context + list(request.continuations[0]) if request.continuations else context
        start = len(context) if request.continuations else 1
        expected, rows = _reference(model, sequence, start)
        assert result.token_ids == sequence[start:]
        assert len(result.logprobs) == len(expected) == len(sequence) - start, name
        assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) <= TOLERANCE, name
        assert result.score.logprob == pytest.approx(sum(expected), abs=TOLERANCE * len(expected))
        if not top_logprobs:
            continue
        top = rows.topk(top_logprobs, dim=-1)
        assert len(result.top_logprobs) == len(top.indices), name
        for (ids, values), want_ids, want_values in zip(result.top_logprobs, top.indices, top.values):
            assert values == pytest.approx(want_values.tolist(), abs=TOLERANCE)
            assert ids[0] == int(want_ids[0])


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_each_token_logprob_equals_an_independent_forward(name):
    model = _model(name, vocab_size=1024)
    requests = _requests(seed=1)
    check_against_forward(model, requests, _score(model, requests, top_logprobs=3), name, top_logprobs=3)


def test_scores_do_not_depend_on_the_batch():
    """The same rows alone, in batches of another size and in another order give the same scores."""
    model = _model("llama", vocab_size=1024)
    requests = _requests(seed=2, count=12)
    together = _score(model, requests, batch_tokens=4096)
    alone = _score(model, requests[::-1], batch_tokens=16)
    for key, result in together.items():
        other = alone[key]
        if result.score.choice_logprobs is not None:
            assert result.score.choice_logprobs == pytest.approx(other.score.choice_logprobs, abs=TOLERANCE)
        else:
            assert result.logprobs == pytest.approx(other.logprobs, abs=TOLERANCE)


def test_choices_share_one_prompt_pass():
    """A row's choices sit side by side behind one copy of its prompt: the tokens of the forward pass are the
    prompt's once plus each choice's."""
    model = _model("llama", vocab_size=1024)
    request = _requests(seed=3, count=3)[2]
    assert request.has_choices
    scorer = Scorer(model, batch_tokens=4096)
    list(scorer.run(iter([request]), threading.Event()))
    assert scorer.stats.forward_passes == 1
    assert scorer.stats.tokens == len(request.context) + sum(map(len, request.continuations))


def test_logits_are_worked_in_bounded_chunks(monkeypatch):
    """A long text never has more than a chunk of positions' logits at once, and its scores stay exact."""
    monkeypatch.setattr(head_module, "LOGITS_BYTES", 4 * 1024 * 40)  # 40 positions of a 1024-token vocabulary
    model = _model("llama", vocab_size=1024, max_position_embeddings=2048)
    text = torch.randint(3, 1000, (1500,), generator=torch.Generator().manual_seed(4)).tolist()
    record = PromptRecord(id="long", index=0, location="rows.jsonl:1", target=ScoreTarget(text="t"))
    widest = []
    projection = model.get_output_embeddings()
    original = projection.forward
    monkeypatch.setattr(projection, "forward", lambda hidden: widest.append(hidden.shape[0]) or original(hidden))
    result = _score(model, [ScoreRequest(Request(record, input_ids=text))], batch_tokens=4096)["long"]
    monkeypatch.setattr(projection, "forward", original)
    expected, _ = _reference(model, text, 1)
    assert len(result.logprobs) == len(expected) == len(text) - 1
    assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) <= TOLERANCE
    scoring_calls = widest[2:]  # the first two: the probe that checks the head against the model's own forward
    assert max(scoring_calls) == 40 and sum(scoring_calls) == len(text) - 1


def test_a_head_the_scorer_does_not_know_is_refused(monkeypatch):
    """An architecture whose forward does more after its projection than the scorer applies stops the job with
    a message, instead of writing wrong scores."""
    from cbgen.errors import CbgenError

    model = _model("llama", vocab_size=1024)
    monkeypatch.setattr(head_module, "output_head", lambda m: (lambda hidden: m.lm_head(hidden) * 2.0))
    import cbgen.score.scorer as scorer_module

    monkeypatch.setattr(scorer_module, "output_head", head_module.output_head)
    with pytest.raises(CbgenError, match="cannot reproduce"):
        _score(model, _requests(seed=5, count=1))
