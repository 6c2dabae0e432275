"""What the writer stores for an encoded row: its embedding (embed) or its outputs, one column per label (reward),
with the tokens read, whether they were cut, and the kept columns."""

from __future__ import annotations

from typing import Any

from cbgen.records import Completion
from cbgen.rows.columns import OutputColumns


class EncodedRows:
    """Turns an encoded request into its row, with exactly the job's `columns`; `label_names` are the reward
    model's own names of its outputs (for the best label)."""

    def __init__(self, columns: OutputColumns, label_names: tuple[str, ...] = ()) -> None:
        self.columns = columns
        self.label_names = label_names

    def __call__(self, group: list[Completion]) -> list[dict[str, Any]]:
        return [self.row(completion) for completion in group]

    def row(self, completion: Completion) -> dict[str, Any]:
        record = completion.request.record
        names = self.columns.names
        row: dict[str, Any] = dict.fromkeys(names)
        row["id"] = record.id
        row["error"] = completion.error
        vector = completion.vector if completion.error is None else None
        if vector is not None:
            row["num_tokens"] = len(completion.token_ids)
            row["truncated"] = completion.finish_reason == "length"
            if "embedding" in row:
                row["embedding"] = vector
            for name, value in zip(self.columns.labels, vector):
                row[name] = value
            if "label" in row and self.label_names:
                row["label"] = self.label_names[max(range(len(vector)), key=vector.__getitem__)]
        else:
            row["num_tokens"], row["truncated"] = 0, False
        for name in self.columns.kept:
            row[name] = record.kept.get(name)
        return row
