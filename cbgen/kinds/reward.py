"""The reward kind (`kind: reward`): a sequence-classification model's outputs for each row's conversation
(cbgen.encoders): a reward model's score, or a classifier's probability per label; nothing generated."""

from __future__ import annotations

import dataclasses
from typing import Any

from cbgen.kinds.base import EncoderKind
from cbgen.records import REWARD_FIELDS

BEST_LABEL = "label"  # a classifier's most likely label


class Reward(EncoderKind):
    name = "reward"
    own_section = "reward"
    generation_keys = frozenset({"chat_template_kwargs"})
    card_title = "Rewards by cbgen"
    card_verb = "rated"
    starting = "rating"
    card_settings = "reward"
    embedded = None
    reads = ("completion", "text")
    work = "rating"
    verb = "rating"
    meanings = {
        "num_tokens": "tokens the model read (the conversation in its chat template, after truncation)",
        "truncated": "whether the conversation was longer than the model's max length and cut to it",
        "label": "the classifier's most likely label",
        "error": "why the row could not be rated, else null",
    }

    def column_names(self, columns: Any) -> tuple[str, ...]:
        best = (BEST_LABEL,) if len(columns.labels) > 1 else ()
        return (*REWARD_FIELDS[:-1], *best, *columns.labels, REWARD_FIELDS[-1], *columns.kept)

    def reserved_names(self) -> frozenset[str]:
        return frozenset((*REWARD_FIELDS, BEST_LABEL))

    def identifies(self, columns: set[str] | frozenset[str]) -> bool:
        return "num_tokens" in columns and "embedding" not in columns

    def fingerprint(self, job: Any, fingerprint: dict[str, Any]) -> dict[str, Any]:
        reward = {k: v for k, v in dataclasses.asdict(job.reward).items() if k != "batch_tokens"}
        return ({k: v for k, v in fingerprint.items() if k != "generation"}
                | {"kind": self.name, "reward": reward,
                   "generation": {"chat_template_kwargs": job.generation.chat_template_kwargs}})
