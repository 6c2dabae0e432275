"""What the writer stores for a scored row: the score fields (cbgen.records.SCORE_FIELDS), the scored tokens with
their logprobs on request, and the kept columns."""

from __future__ import annotations

import math
from typing import Any

from cbgen.records import SCORE_FIELDS, Completion
from cbgen.rows.columns import OutputColumns


class ScoreRows:
    """Turns a scored request into its row, with exactly the job's `columns`. The tokenizer names the tokens of
    `top_logprobs`; without one (no model loaded: every row was refused) only error rows can be made."""

    def __init__(self, columns: OutputColumns, tokenizer: Any = None) -> None:
        self.columns = columns
        self.tokenizer = tokenizer
        self._tokens: dict[int, str] = {}

    def __call__(self, group: list[Completion]) -> list[dict[str, Any]]:
        return [self.row(completion) for completion in group]

    def row(self, completion: Completion) -> dict[str, Any]:
        record = completion.request.record
        row: dict[str, Any] = dict.fromkeys(SCORE_FIELDS)
        row["id"] = record.id
        row["error"] = completion.error
        target = record.target
        if target is not None:
            row["choices"] = list(target.choices) if target.choices is not None else None
        score = completion.score
        context = completion.num_prompt_tokens
        if score is not None and score.choice_logprobs is not None:
            row.update(_choices(score.choice_logprobs, score.choice_tokens or [], row["choices"] or []))
            row["num_prompt_tokens"] = context
            row["num_scored_tokens"] = sum(score.choice_tokens or [])
        elif score is not None and score.logprob is not None:
            scored = len(completion.token_ids)
            mean = score.logprob / scored
            row.update(logprob=score.logprob, mean_logprob=mean, perplexity=_exp(-mean), num_scored_tokens=scored,
                       num_prompt_tokens=context)
        else:
            row["num_prompt_tokens"], row["num_scored_tokens"] = 0, 0
        per_token = score is not None and score.logprob is not None
        if self.columns.logprobs:
            row["token_ids"] = completion.token_ids if per_token else None
            row["logprobs"] = completion.logprobs if per_token else None
        if self.columns.top_logprobs:
            top = completion.top_logprobs if per_token else None
            row["top_logprobs"] = [[{"token_id": t, "token": self.token(t), "logprob": v} for t, v in zip(*position)]
                                   for position in top] if top is not None else None
        for name in self.columns.kept:
            row[name] = record.kept.get(name)
        return row

    def token(self, token_id: int) -> str:
        text = self._tokens.get(token_id)
        if text is None:
            text = self._tokens[token_id] = self.tokenizer.decode([token_id])
        return text


def _choices(sums: list[float], lengths: list[int], choices: list[str]) -> dict[str, Any]:
    """Each choice's summed and mean logprob, their probabilities among themselves, and the best one."""
    best = max(sums)
    weights = [math.exp(value - best) for value in sums]  # a softmax that cannot overflow
    total = sum(weights)
    return {"choice_logprobs": sums, "choice_mean_logprobs": [s / n for s, n in zip(sums, lengths)],
            "choice_probs": [w / total for w in weights], "best_choice": choices[sums.index(best)]}


def _exp(value: float) -> float:
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf
