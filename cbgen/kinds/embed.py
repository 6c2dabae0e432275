"""The embed kind (`cbgen embed`, `kind: embed`): each row's text as one pooled vector from an embedding model
(cbgen.encoders); nothing generated."""

from __future__ import annotations

import dataclasses
from typing import Any

from cbgen.kinds.base import EncoderKind
from cbgen.records import EMBED_FIELDS


class Embed(EncoderKind):
    name = "embed"
    command = "cbgen embed"
    own_section = "embed"
    generation_keys = frozenset()
    card_title = "Embeddings by cbgen"
    card_verb = "embedded"
    starting = "embedding"
    card_settings = "embed"
    embedded = "embedder"
    reads = ("text",)
    work = "embedding"
    verb = "embedding"
    raw_prompts = True
    pooled = True
    meanings = {
        "embedding": "the text's pooled embedding (float32; unit length when the model normalises)",
        "num_tokens": "tokens the model read (after truncation to its max length)",
        "truncated": "whether the text was longer than the model's max length and cut to it",
        "error": "why the row could not be embedded, else null",
    }

    def column_names(self, columns: Any) -> tuple[str, ...]:
        return (*EMBED_FIELDS, *columns.kept)

    def reserved_names(self) -> frozenset[str]:
        return frozenset(EMBED_FIELDS)

    def identifies(self, columns: set[str] | frozenset[str]) -> bool:
        return "embedding" in columns

    def fingerprint(self, job: Any, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """What is embedded, and how; no generation setting applies (the batch size changes float rounding
        only)."""
        embed = {k: v for k, v in dataclasses.asdict(job.embed).items() if k not in ("batch_tokens", "packed")}
        return {k: v for k, v in fingerprint.items() if k != "generation"} | {"kind": self.name, "embed": embed}
