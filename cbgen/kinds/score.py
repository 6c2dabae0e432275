"""The score kind (`cbgen score`, `kind: score`): the model's logprobs of each row's completion, text or choices;
nothing generated."""

from __future__ import annotations

import dataclasses
from typing import Any

from cbgen.kinds.base import Kind
from cbgen.records import SCORE_FIELDS, SCORE_RESERVED_NAMES


class Score(Kind):
    name = "score"
    command = "cbgen score"
    generates = False
    own_section = "score"
    generation_keys = frozenset({"logprobs", "top_logprobs"})  # the scored tokens' own, on request
    card_title = "Scores by cbgen"
    card_verb = "scored"
    starting = "scoring"
    card_settings = "score"
    runner = "scorer"
    reads = ("choices", "completion", "text")
    completion_required = True
    verb = "scoring"
    meanings = {
        "num_prompt_tokens": "tokens before the scored ones (the prompt; a text's first token)",
        "token_ids": "the scored token ids",
        "logprobs": "the model's own log-probability of each scored token",
        "top_logprobs": "per scored token, the most likely tokens with their logprobs",
        "error": "why the row could not be scored, else null",
    }

    def column_names(self, columns: Any) -> tuple[str, ...]:
        return (*SCORE_FIELDS, *(("token_ids", "logprobs") if columns.logprobs else ()),
                *(("top_logprobs",) if columns.top_logprobs else ()), *columns.kept)

    def reserved_names(self) -> frozenset[str]:
        return SCORE_RESERVED_NAMES

    def identifies(self, columns: set[str] | frozenset[str]) -> bool:
        return "num_scored_tokens" in columns

    def fingerprint(self, job: Any, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """What is scored, and how; no generation setting but the logprobs asked for applies."""
        g = job.generation
        return fingerprint | {"kind": self.name,
                              "score": {k: v for k, v in dataclasses.asdict(job.score).items() if k != "batch_tokens"},
                              "generation": {"logprobs": g.logprobs, "top_logprobs": g.top_logprobs}}

    def redo_kinds(self, kinds: list[str]) -> list[str]:
        return [k for k in kinds if k != "length"]  # a score is never cut

    def counts(self, summary: Any) -> dict[str, int]:
        return {"rows": summary.requests, "failed": summary.failed, "succeeded": summary.succeeded,
                "prompt_tokens": summary.prompt_tokens, "scored_tokens": summary.generated_tokens,
                "resumed_rows": summary.resumed_requests}

    def summary_rows(self, summary: Any, duration: Any, cache_line: Any) -> list[tuple[str, str]]:
        seconds = summary.generation_seconds or float("nan")
        tokens = summary.run_prompt_tokens + summary.run_generated_tokens
        return [
            ("model", str(summary.model)),
            ("rows scored / failed", f"{summary.succeeded} / {summary.failed}"),
            ("prompt / scored tokens", f"{summary.prompt_tokens:,} / {summary.generated_tokens:,}"),
            ("tokens/s (prompt + scored)", f"{tokens / seconds:,.1f}"),
            self.timings_row(summary, duration, "scoring"),
            ("forward passes", f"{summary.scorer.get('forward_passes', 0):,}"),
            ("result cache", cache_line(summary.result_cache)),
            self.output_row(summary),
        ]
