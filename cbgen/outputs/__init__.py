"""Output rows and the shard writers that put them on disk (JSONL or Parquet)."""

from cbgen.outputs.schema import BASE_FIELDS, RESERVED_NAMES, arrow_schema, infer_kept_schema
from cbgen.outputs.writers import (
    JsonlShardWriter,
    ParquetShardWriter,
    ShardWriter,
    open_writer,
    read_shards,
)

__all__ = [
    "BASE_FIELDS",
    "RESERVED_NAMES",
    "JsonlShardWriter",
    "ParquetShardWriter",
    "ShardWriter",
    "arrow_schema",
    "infer_kept_schema",
    "open_writer",
    "read_shards",
]
