"""Prompts handed over in memory (the Python API): a list of strings, of chat message lists, of row dicts, or a
`datasets.Dataset`. Each item is a row as a file's would be, so ids, row settings, templates and row errors work as
for every other input."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cbgen.inputs.base import Reader

if TYPE_CHECKING:
    from cbgen.inputs.scoring import ScoreFields
    from cbgen.render.templates import PromptTemplate


def as_row(item: Any) -> dict[str, Any] | None:
    """A prompt item as a row: text is a prompt, a list of messages a chat, a mapping the row itself."""
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, list) and all(isinstance(m, dict) for m in item):
        return {"messages": item}
    if isinstance(item, dict):
        return item
    return None


class MemoryReader(Reader):
    """Rows from a sequence in memory; `prompts[i]` names row i in messages."""

    def __init__(self, items: Sequence[Any], *, keep_columns: Sequence[str] = (), id_column: str | None = None,
                 template: PromptTemplate | None = None, score: ScoreFields | None = None) -> None:
        super().__init__("prompts", prompt_column=None, id_column=id_column, keep_columns=keep_columns,
                         template=template, score=score)
        self.items = items  # a list, or a datasets.Dataset (indexable and sized alike)
        if len(items):
            self._detect_id_column(list(as_row(items[0]) or {}))  # rows with an `id` field are known by it

    def _rows(self) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
        for i, item in enumerate(self.items):
            row = as_row(item)
            error = None if row is not None else (f"a prompt must be text, a list of messages or a dict, got "
                                                  f"{type(item).__name__}")
            yield f"prompts[{i}]", row, error

    def _ids(self) -> Iterator[tuple[int, Any]]:
        for i, item in enumerate(self.items):
            row = as_row(item)
            if row is not None and self.id_column is not None:
                yield i, row.get(self.id_column)

    def _where(self, position: int, first: int) -> tuple[str, str]:
        return f"prompts[{position}]", f"first seen at prompts[{first}]"

    def count(self) -> int:
        return len(self.items)

    def settings_present(self) -> set[str]:
        return {key for item in self.items if (row := as_row(item)) is not None
                for key in self.row_settings if key in row}
