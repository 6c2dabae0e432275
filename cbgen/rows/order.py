"""Putting a finished run's shards in input order, so that the output directory reads as the input did.

Requests finish in the engine's order, and shards are committed as they finish. Once a run has every request, its
shards are rewritten in the input's order (each shard sorted in memory, then merged: memory stays bounded by a
shard), into new shards numbered after the old ones in a staging folder. A journal naming the old set and the new
one is the commit point; then the old shards are removed and the new ones moved into place. Readers
(cbgen.rows.shards.shard_paths) follow the journal while it exists, so they always see one whole set, and a run
killed part-way is finished by the next one (cbgen.rows.shards.finish_reorder).
"""

from __future__ import annotations

import heapq
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.files import write_json_atomic
from cbgen.rows.columns import OutputColumns
from cbgen.rows.shards import ORDER_JOURNAL, ORDER_STAGING, finish_reorder, read_shard, row_key, shard_paths

if TYPE_CHECKING:
    import pyarrow as pa

Position = Mapping[str, int]  # request id -> its row's position in the input


def in_order(directory: Path, positions: Position) -> bool:
    """Whether the committed shards already hold their rows in input order."""
    last = -1
    for _, path in shard_paths(directory):
        for row in read_shard(path, ["id"], as_rows=False):
            position = positions.get(row_key(row), -1)
            if position < last:
                return False
            last = position
    return True


def put_in_input_order(directory: Path, positions: Position, fmt: str, rows_per_shard: int, columns: OutputColumns,
                       kept_schema: pa.Schema | None) -> bool:
    """Rewrites the locked `directory`'s shards in input order (rows of ids without a position last, as found);
    returns whether it had to."""
    from cbgen.rows.writers import open_writer

    directory = Path(directory)
    finish_reorder(directory)
    shards = shard_paths(directory)
    if not shards or in_order(directory, positions):
        return False
    staging = directory / ORDER_STAGING
    shutil.rmtree(staging, ignore_errors=True)
    writer = open_writer(fmt, staging, rows_per_shard=rows_per_shard, columns=columns, kept_schema=kept_schema,
                         first_shard=shards[-1][0] + 1)
    with writer:
        for group in _groups(heapq.merge(*(_sorted(path, positions) for _, path in shards),
                                         key=lambda item: item[0])):
            writer.write_group(group)
    write_json_atomic(directory / ORDER_JOURNAL, {"old": [p.name for _, p in shards],
                                                  "new": [p.name for p in writer.shards]})
    finish_reorder(directory)
    return True


def rows_in_order(directories: list[Path], positions: Position) -> Iterator[dict[str, Any]]:
    """The stored rows of several directories of one job (the shards of a split job), in input order: each
    directory's rows are merged by position, read as they are where already in order (a complete run's are), else
    sorted shard by shard first."""
    unknown = len(positions)
    streams = []
    for directory in directories:
        if in_order(directory, positions):
            streams.append((positions.get(row_key(row), unknown), row)
                           for _, path in shard_paths(directory) for row in read_shard(path, as_rows=False))
        else:
            streams.append(heapq.merge(*(_sorted(path, positions) for _, path in shard_paths(directory)),
                                       key=lambda item: item[0]))
    for _, row in heapq.merge(*streams, key=lambda item: item[0]):
        yield row


def _sorted(path: Path, positions: Position) -> Iterator[tuple[int, dict[str, Any]]]:
    """One shard's rows as (position, row), sorted by position (stable: a request's sequences keep their order)."""
    rows = list(read_shard(path, as_rows=False))
    unknown = len(positions)
    return iter(sorted(((positions.get(row_key(row), unknown), row) for row in rows), key=lambda item: item[0]))


def _groups(items: Iterator[tuple[int, dict[str, Any]]]) -> Iterator[list[dict[str, Any]]]:
    """The rows of each request together (a request's sequences share a shard)."""
    group: list[dict[str, Any]] = []
    for _, row in items:
        if group and row_key(group[0]) != row_key(row):
            yield group
            group = []
        group.append(row)
    if group:
        yield group
