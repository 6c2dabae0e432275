"""What writes a job's rows, below the engine: which columns rows have (columns.py), what a finished request becomes
(request_rows.py, parsed.py), the shard writers that put them on disk (writers.py, schema.py) and reading them back
(shards.py), and the run directory (lock, fingerprint, resume index: rundir.py; --redo: redo.py; input order:
order.py). What records a run (its summary, run.json, the card, the folder as a dataset, status and merge) is
cbgen.outputs, above the engine."""

from cbgen.rows.shards import read_shards
from cbgen.rows.writers import (
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
