"""The penalties' state kept on the device from step to step (cbgen.control.penalties.HistoryTensors) gives each step
exactly what a state seeded afresh from the whole history gives: as sequences grow a token a step, end (their slots
freed and taken by new ones) and come back after the lists have grown, with prompt ids past the logits' width, in
float32 and bfloat16."""

from __future__ import annotations

import random

import pytest
import torch

from cbgen.control.history_tensors import HistoryTensors
from cbgen.control.penalties import Controls, History, apply_history

VOCAB = 300
CONTROLS = [Controls(repetition_penalty=1.4), Controls(presence_penalty=0.6, frequency_penalty=-0.3),
            Controls(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=0.25,
                     logit_bias=((3, 2.5), (VOCAB + 1, 1.0))),
            Controls(no_repeat_ngram_size=2)]


def _history(rng: random.Random, k: int) -> tuple[History, list[int], list[int]]:
    prompt = [rng.randrange(VOCAB + 20) for _ in range(rng.randrange(1, 40))]  # some ids past the logits' width
    history = History(CONTROLS[k % len(CONTROLS)])
    return history, prompt, []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kept_state_is_the_state_seeded_afresh(dtype):
    rng = random.Random(7)
    kept = HistoryTensors()
    sequences = [_history(rng, k) for k in range(12)]
    made = len(sequences)
    for step in range(120):
        for history, prompt, generated in sequences:
            history.sync(prompt, generated, len(prompt))
        scores = (torch.randn(len(sequences) + 1, VOCAB, generator=torch.Generator().manual_seed(step)) * 4).to(dtype)
        rows = [(i + 1, h) for i, (h, _, _) in enumerate(sequences)]  # row 0 has no history
        ours, fresh = scores.clone(), scores.clone()
        apply_history(ours, rows, (), kept)
        apply_history(fresh, rows, ())
        assert torch.equal(ours, fresh), step
        assert torch.equal(ours[0], scores[0])
        for _, _, generated in sequences:  # a token each, often one seen before
            generated.append(rng.choice(generated[-6:]) if generated and rng.random() < 0.25 else rng.randrange(VOCAB))
        if step % 15 == 14:  # some end; new ones take their slots
            for i in rng.sample(range(len(sequences)), 2):
                kept.release(sequences[i][0])
                sequences[i] = _history(rng, made)
                made += 1
    assert kept.seen.ids.size(1) > 64 and kept.generated.ids.size(1) > 64  # the lists grew past their first width
