"""`cbgen bench`'s scoring paths, on the `scoring` workload: cbgen's scorer (the `cbgen` path, as `cbgen score`
runs it) against a plain loop of the model's forward pass over padded batches of the same rows in input order
(`forward-B`), which is what a script computing the same logprobs with transformers alone does: every choice
after its own copy of the prompt, the logits of every position, their log-softmax, then the scored tokens picked.

Both count the same tokens (each row's as cbgen scores it: the prompt once, then its continuations), so their
rates compare; each measurement also says how far its scores are from the scorer's.
"""

from __future__ import annotations

import threading
import time

import torch

from cbgen.bench.workloads import BenchWorkload, Measurement
from cbgen.model.load import LoadedModel
from cbgen.records import PromptRecord, Request, ScoreTarget
from cbgen.score.requests import ScoreRequest

BATCH_TOKENS = 4096  # the scorer's default (--score-batch-tokens)


def _requests(workload: BenchWorkload) -> list[ScoreRequest]:
    assert workload.continuations is not None and workload.choices is not None
    requests = []
    for i, (prompt, continuations) in enumerate(zip(workload.prompts, workload.continuations)):
        if not continuations:
            target = ScoreTarget(text="")
        elif workload.choices[i]:
            target = ScoreTarget(choices=tuple(str(k) for k in range(len(continuations))))
        else:
            target = ScoreTarget(completion="")
        record = PromptRecord(id=str(i), index=i, location=f"{workload.name}#{i}", target=target)
        requests.append(ScoreRequest(Request(record, input_ids=list(prompt)), continuations))
    return requests


def _tokens(workload: BenchWorkload) -> int:
    assert workload.continuations is not None
    return sum(len(p) + sum(map(len, c)) for p, c in zip(workload.prompts, workload.continuations))


def scorer(loaded: LoadedModel, workload: BenchWorkload, invariant: bool | None = None, path: str = "cbgen"
           ) -> tuple[Measurement, list[list[float]]]:
    """The workload through cbgen's scorer, with what `cbgen score` installs for it (`invariant`: --batch-invariant
    or --no-batch-invariant; None: the default, rows packed through the compiled attention where it serves); with each
    row's scores (summed per unit: completion, text, or choice)."""
    from cbgen.config import JobConfig
    from cbgen.engine.setup import plan_scoring_scope
    from cbgen.score.scorer import Scorer

    job = JobConfig(kind="score")
    job.model.batch_invariant = invariant
    requests = _requests(workload)
    engine = Scorer(loaded.model, batch_tokens=BATCH_TOKENS, scope=plan_scoring_scope(job, loaded))
    scores: list[list[float]] = [[] for _ in requests]
    start = time.perf_counter()
    for group in engine.run(iter(requests), threading.Event()):
        result = group[0]
        assert result.error is None and result.score is not None, result.error
        index = result.request.record.index
        scores[index] = result.score.choice_logprobs or [result.score.logprob or 0.0]
    seconds = time.perf_counter() - start
    extra = {"forward_passes": engine.stats.forward_passes, "padded_tokens": engine.stats.padded_tokens,
             "packed_rows": engine.packed}
    return Measurement(workload.name, path, seconds, len(requests), _tokens(workload), 0, extra), scores


@torch.inference_mode()
def padded_forward(loaded: LoadedModel, workload: BenchWorkload, batch_size: int, reference: list[list[float]]
                   ) -> Measurement:
    """The workload as a script would score it: each row's sequences (a choice after its own copy of the prompt),
    `batch_size` at a time in input order, padded on the right, the model's logits and log-softmax over every
    position; `reference` (the scorer's sums) gives the largest difference between the two."""
    assert workload.continuations is not None
    model = loaded.model
    sequences: list[tuple[int, list[int], int]] = []  # (row, tokens, first scored position)
    for row, (prompt, continuations) in enumerate(zip(workload.prompts, workload.continuations)):
        if not continuations:
            sequences.append((row, list(prompt), 1))
        sequences += [(row, list(prompt) + list(c), len(prompt)) for c in continuations]
    sums: list[list[float]] = [[] for _ in workload.prompts]
    padded = 0
    start = time.perf_counter()
    for i in range(0, len(sequences), batch_size):
        batch = sequences[i:i + batch_size]
        width = max(len(tokens) for _, tokens, _ in batch)
        ids = torch.tensor([tokens + [0] * (width - len(tokens)) for _, tokens, _ in batch], device=model.device)
        mask = torch.tensor([[1] * len(tokens) + [0] * (width - len(tokens)) for _, tokens, _ in batch],
                            device=model.device)
        logprobs = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        padded += ids.numel()
        for b, (row, tokens, first) in enumerate(batch):
            targets = torch.tensor(tokens[first:], device=model.device)
            sums[row].append(float(logprobs[b, first - 1:len(tokens) - 1].gather(1, targets[:, None]).sum()))
    seconds = time.perf_counter() - start
    difference = max(abs(a - b) for mine, theirs in zip(sums, reference) for a, b in zip(mine, theirs))
    return Measurement(workload.name, f"forward-{batch_size}", seconds, len(workload.prompts), _tokens(workload), 0,
                       {"padded_tokens": padded, "max_abs_diff_vs_cbgen": round(difference, 5)})
