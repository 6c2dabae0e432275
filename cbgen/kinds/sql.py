"""The sql kind (`kind: sql` in a pipeline): one DuckDB SELECT over earlier stages' tables, written whole; no model,
no rows of its own to resume (cbgen.pipelines.sql runs it)."""

from __future__ import annotations

from cbgen.kinds.base import Kind

QUERY_KEYS = ("query", "read_files")  # what an sql stage takes besides its name and kind


class Sql(Kind):
    name = "sql"
    over_rows = False
    generates = False
    adapters = ""
    runner = "query"

    def setting_error(self, section: str, key: str, own_sections: frozenset[str]) -> str | None:
        return f"an sql stage takes only name, kind, {' and '.join(QUERY_KEYS)}, not {key!r}"
