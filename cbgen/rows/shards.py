"""The committed shards of a run directory: which they are, what they hold, and reading them back. A shard appears
under its final name `part-NNNNN.jsonl` / `.parquet` only once complete (cbgen.rows.writers); hidden temporary
files are never shards. While a run puts its shards in input order (cbgen.rows.order), a journal names the set
that holds, so every reader sees either the old shards or the new ones, whole; `settle` finishes what a killed run
left of that, and of its temporary files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbgen.chat.openai_batch import OutputLine
from cbgen.files import fsync_directory, read_json_or_none

SHARD_NAME = re.compile(r"^part-(\d+)\.(jsonl|parquet)$")
ORDER_JOURNAL = ".ordered.json"  # {"old": [names], "new": [names]}: the new set holds (cbgen.rows.order)
ORDER_STAGING = ".ordered"  # where the new set is written before it takes the old one's place
ROW_GROUP = 1000  # rows read from Parquet at a time


def row_key(row: dict[str, Any]) -> str:
    """The request id of a stored row (OpenAI batch output lines carry it as custom_id)."""
    return str(row["custom_id"] if "custom_id" in row else row.get("id"))


def shard_paths(directory: Path) -> list[tuple[int, Path]]:
    """The committed shards in `directory` as (number, path), in order; temporary shards are not listed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    journal = read_json_or_none(directory / ORDER_JOURNAL)
    if isinstance(journal, dict) and isinstance(journal.get("new"), list):
        found = []
        for name in journal["new"]:
            path = directory / name
            match = SHARD_NAME.match(name)
            if match:
                found.append((int(match.group(1)), path if path.exists() else directory / ORDER_STAGING / name))
        return found
    return sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := SHARD_NAME.match(p.name)))


def settle(directory: Path, *, clear: bool = False) -> list[tuple[int, Path]]:
    """The committed shards of the locked `directory` (as `shard_paths`), once what a killed run was still writing is
    gone: hidden `.*.tmp` files, and a reorder into input order that it had not committed (one it had committed is
    finished). `clear` (--overwrite) removes the committed shards too."""
    directory = Path(directory)
    for path in directory.glob(".*.tmp"):
        path.unlink(missing_ok=True)
    finish_reorder(directory)
    shutil.rmtree(directory / ORDER_STAGING, ignore_errors=True)
    # no journal is left: the shards are the files of their names (as `shard_paths` lists them without one)
    shards = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := SHARD_NAME.match(p.name)))
    if clear:
        for _, path in shards:
            path.unlink()
        shards = []
    return shards


def finish_reorder(directory: Path) -> None:
    """Completes a reorder whose journal exists: the old shards go, the new ones take their place."""
    directory = Path(directory)
    journal = read_json_or_none(directory / ORDER_JOURNAL)
    if not isinstance(journal, dict):
        return
    for name in journal.get("old", []):
        (directory / name).unlink(missing_ok=True)
    staging = directory / ORDER_STAGING
    for name in journal.get("new", []):
        if (staging / name).exists():
            (staging / name).replace(directory / name)
    fsync_directory(directory)
    (directory / ORDER_JOURNAL).unlink(missing_ok=True)
    shutil.rmtree(staging, ignore_errors=True)


@dataclass
class DoneIndex:
    """What the committed shards of a directory already hold."""

    ids: set[str] = field(default_factory=set)
    requests: int = 0
    failed_requests: int = 0
    sequences: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    next_shard: int = 0
    loop_stopped: int = 0  # sequences the loop stop ended (finish_reason "repetition")
    loop_generated_tokens: int = 0  # the tokens those generated

    @property
    def succeeded(self) -> int:
        return self.sequences - self.failed


def done_index(shards: list[tuple[int, Path]]) -> DoneIndex:
    """The ids and counts of the committed `shards` (`shard_paths`). A request's sequences are always committed
    together, so an id present once is done."""
    index = DoneIndex()
    if shards:
        index.next_shard = shards[-1][0] + 1
    # score rows (cbgen score) have no finish_reason, and count their scored tokens; embed and reward rows count the
    # tokens they read as num_tokens
    columns = ["id", "finish_reason", "error", "num_prompt_tokens", "num_generated_tokens", "num_scored_tokens",
               "num_tokens"]
    failed_ids: set[str] = set()
    for row in (row for _, path in shards for row in read_shard(path, columns)):
        index.sequences += 1
        index.generated_tokens += row.get("num_generated_tokens", row.get("num_scored_tokens")) or 0
        if row.get("finish_reason", "error" if row.get("error") is not None else None) == "error":
            index.failed += 1
            failed_ids.add(row["id"])
        if row.get("finish_reason") == "repetition":
            index.loop_stopped += 1
            index.loop_generated_tokens += row.get("num_generated_tokens") or 0
        if row["id"] not in index.ids:
            index.ids.add(row["id"])
            index.requests += 1
            index.prompt_tokens += row.get("num_prompt_tokens", row.get("num_tokens")) or 0
    index.failed_requests = len(failed_ids)
    return index


def read_shards(directory: Path, columns: Sequence[str] | None = None, *, as_rows: bool = True
                ) -> Iterator[dict[str, Any]]:
    """Every row of the committed shards in `directory`, in shard order; temporary shards are skipped.
    `columns` limits what is read from Parquet shards (JSONL rows are always read whole; a column a shard does not
    have is left out of its rows, as score rows have no finish_reason). OpenAI batch output lines
    come back as the cbgen rows they stand for (see `OutputLine.rows`), unless `as_rows` is False."""
    for _, path in shard_paths(directory):
        yield from read_shard(path, columns, as_rows=as_rows)


def read_shard(path: Path, columns: Sequence[str] | None = None, *, as_rows: bool = True) -> Iterator[dict[str, Any]]:
    """The rows of one shard (see `read_shards`)."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    if as_rows and OutputLine.matches(row):
                        yield from OutputLine.from_dict(row).rows()
                    else:
                        yield row
    else:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if columns is not None:
            columns = [name for name in columns if name in parquet.schema_arrow.names]
        for batch in parquet.iter_batches(batch_size=ROW_GROUP, columns=columns):
            yield from batch.to_pylist()


def take_out(shards: list[tuple[int, Path]], ids: set[str]) -> int:
    """Takes every row of the requests `ids` out of the committed `shards` (`settle`) of a locked directory, each
    shard rewritten whole (`rewrite_shard`); returns how many rows left."""
    return sum(rewrite_shard(path, lambda row: row_key(row) not in ids) for _, path in shards)


def rewrite_shard(path: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Keeps only the rows of a committed shard (the lines, for OpenAI batch output) that `keep` accepts: the shard is
    written anew under a temporary name and renamed over itself, so a reader sees the old one or the new one whole;
    a shard left empty is removed. Returns how many rows it dropped."""
    temp = path.with_name(f".{path.name}.rewrite.tmp")
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        kept = [line for line in lines if keep(json.loads(line))]
        dropped = len(lines) - len(kept)
        if dropped and kept:
            with open(temp, "w", encoding="utf-8") as out:
                out.writelines(kept)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        mask = pa.array([keep(row) for row in table.to_pylist()], type=pa.bool_())
        dropped = len(table) - sum(mask.to_pylist())
        if dropped and dropped < len(table):
            pq.write_table(table.filter(mask), temp)
    if dropped == 0:
        return 0
    if temp.exists():
        with open(temp, "rb") as written:  # its bytes on disk before the rename makes it the shard
            os.fsync(written.fileno())
        os.replace(temp, path)
    else:
        path.unlink()
    fsync_directory(path.parent)
    return dropped
