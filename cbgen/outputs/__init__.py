"""Outputs: rows (what a finished request becomes), the shard writers that put them on disk (JSONL, Parquet),
the run directory (lock, fingerprint, resume index) and run.json."""

from cbgen.outputs.writers import (
    JsonlShardWriter,
    ParquetShardWriter,
    ShardWriter,
    open_writer,
    read_shards,
)

__all__ = [
    "JsonlShardWriter",
    "ParquetShardWriter",
    "ShardWriter",
    "open_writer",
    "read_shards",
]
