"""An sql stage: a DuckDB query over the tables of the stages it reads, its result written as a dataset. A dedup
stage is written the same way: its query reads its input stage's table, whose duplicates it then drops
(cbgen.pipelines.dedup).

The result goes to a staging folder (Parquet, the card, stage.json with the stage's fingerprint), which then takes
the place of OUT/<name>/ whole: a kill leaves the previous result or none, and the next run computes it again.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from cbgen.files import write_json_atomic, write_text_atomic
from cbgen.outputs.card import CARD_FILE, table_card_text
from cbgen.pipelines.spec import Stage
from cbgen.pipelines.status import SQL_FILE
from cbgen.pipelines.tables import run_query, write_parquet

SHARD = "part-00000.parquet"  # the one shard of its result (as cbgen.rows.shards names shards)


def run_sql_stage(stage: Stage, tables: dict[str, Path], output_dir: Path, fingerprint: dict[str, Any]) -> int:
    """Runs `stage`'s query over `tables` (name -> Parquet file) into OUTPUT_DIR/<name>/; returns its rows."""
    assert stage.query is not None
    result = run_query(stage.query, tables, stage.read_files)
    duplicates = None
    if stage.of_kind.drops_duplicates:  # the input stage's table, without its duplicates
        from cbgen.pipelines.dedup import DUPLICATES_FILE, dedup_table

        result, duplicates = dedup_table(result, stage.settings)
    target = output_dir / stage.name
    staging = output_dir / f".staging-{stage.name}"
    old = output_dir / f".old-{stage.name}"
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    write_parquet(result, staging / SHARD)
    if duplicates is not None:
        write_parquet(duplicates, staging / DUPLICATES_FILE)
    write_text_atomic(staging / CARD_FILE, table_card_text(
        shards=[SHARD], columns=result.schema.names, rows=result.num_rows, stage=stage.name, query=stage.query,
        upstream=list(tables), command=sys.argv, directory=staging))
    write_json_atomic(staging / SQL_FILE, {"kind": stage.kind, "fingerprint": fingerprint, "rows": result.num_rows,
                                           "columns": result.schema.names, "status": "complete",
                                           **({"dropped": duplicates.num_rows} if duplicates is not None else {})})
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return result.num_rows
