"""The dedup kind (`kind: dedup` in a pipeline): an earlier stage's table without its near-duplicates (by an
embedding column and a cosine threshold) or its exact duplicates (by a text column); no model, written whole
(cbgen.pipelines.dedup runs it)."""

from __future__ import annotations

from cbgen.kinds.base import Kind

# what a dedup stage takes besides its name and kind: the stage it reads, and one of the two columns
DEDUP_KEYS = ("input", "embedding_column", "text_column", "threshold")
DEFAULT_THRESHOLD = 0.95


class Dedup(Kind):
    name = "dedup"
    over_rows = False
    generates = False
    adapters = ""
    runner = "query"  # its query reads its input stage's table
    drops_duplicates = True

    def setting_error(self, section: str, key: str, own_sections: frozenset[str]) -> str | None:
        return f"a dedup stage takes only name, kind, {', '.join(DEDUP_KEYS)}, not {key!r}"
