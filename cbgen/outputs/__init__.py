"""Outputs: which columns rows have (columns.py), what a finished request becomes (rows.py, parsed.py), the shard
writers that put them on disk (writers.py, schema.py) and reading them back (shards.py), the run directory (lock,
fingerprint, resume index: rundir.py; --redo: redo.py; input order: order.py), run.json (manifest.py) and the dataset
card (card.py)."""

from cbgen.outputs.shards import read_shards
from cbgen.outputs.writers import (
    JsonlShardWriter,
    ParquetShardWriter,
    ShardWriter,
    open_writer,
)

__all__ = [
    "JsonlShardWriter",
    "ParquetShardWriter",
    "ShardWriter",
    "open_writer",
    "read_shards",
]
