"""The output directory as a dataset: at the end of each run its rows are put in input order (once every request is
written) and its card is written (cbgen.outputs.card), so `datasets.load_dataset(DIR)` and `cbgen.load(DIR)` give
the rows as the input had them."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.config import JobConfig
from cbgen.errors import CbgenError
from cbgen.outputs.card import write_card
from cbgen.process.quiet import quiet
from cbgen.rows.columns import OutputColumns
from cbgen.rows.order import put_in_input_order
from cbgen.rows.rundir import MANIFEST_FILE, read_json, read_stored_run, stored_columns
from cbgen.rows.shards import read_shards, shard_paths

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa


def settle(directory: Path, job: JobConfig, *, model: str, counts: dict[str, Any],
           positions: Mapping[str, int] | None, kept_schema: pa.Schema | None) -> list[str]:
    """Puts the locked run directory's rows in input order when `positions` are given (the run is complete and its
    input can be read again), then writes its card. Returns the shards' names."""
    columns = columns_of(directory)
    if positions is not None and columns is not None:
        put_in_input_order(directory, positions, job.output.format, job.output.rows_per_shard, columns, kept_schema)
    shards = [path.name for _, path in shard_paths(directory)]
    write_card(directory, shards=shards, columns=columns, job=job.to_dict(), model=model, counts=counts,
               command=sys.argv, in_order=positions is not None)
    return shards


def load(directory: str | Path) -> datasets.Dataset:
    """A run's (or a merged job's) rows as a `datasets.Dataset`, in input order once the run is complete; Parquet
    shards keep their types (`parsed` with the schema's fields), JSONL ones take those of cbgen's output schema."""
    import datasets

    from cbgen.rows.schema import arrow_schema, for_arrow, infer_kept_schema

    directory = Path(directory)
    if not shard_paths(directory):
        if any(directory.glob("shard-*-of-*")):
            raise CbgenError(f"'{directory}' holds the shards of a split job: merge them first (cbgen merge "
                             f"{directory}), then load {directory / 'merged'}")
        raise CbgenError(f"'{directory}' holds no output shards of a cbgen run")
    columns = columns_of(directory)
    first = shard_paths(directory)[0][1]
    with quiet("datasets"):
        if first.suffix == ".parquet" or columns is None:
            files = [str(path) for _, path in shard_paths(directory)]
            kind = "parquet" if first.suffix == ".parquet" else "json"
            return datasets.load_dataset(kind, data_files=files, split="train")
        kept = infer_kept_schema(_first(read_shards(directory, as_rows=False)), columns.kept)
        features = datasets.Features.from_arrow_schema(arrow_schema(columns, kept))
        return datasets.Dataset.from_generator(
            lambda: for_arrow(read_shards(directory, as_rows=False), columns, True), features=features)


def _first(rows: Iterator[dict[str, Any]], count: int = 1000) -> list[dict[str, Any]]:
    return [row for _, row in zip(range(count), rows)]


def columns_of(directory: Path) -> OutputColumns | None:
    """The columns of a run directory's rows (fingerprint.json), or of a merged one's (its run.json)."""
    stored = read_stored_run(directory)
    if stored is not None:
        return stored_columns(directory, stored)
    merged = read_json(Path(directory) / MANIFEST_FILE) or {}
    return OutputColumns.from_dict(merged["columns"]) if isinstance(merged.get("columns"), dict) else None
