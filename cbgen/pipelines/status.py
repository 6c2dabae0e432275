"""Each stage's progress in a pipeline's output directory, for `cbgen status OUT` (and its --json)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbgen.errors import CbgenError
from cbgen.files import read_json_or_none
from cbgen.kinds import kind_of

PIPELINE_FILE = "pipeline.json"  # in OUT: the pipeline's stages, written by every run
SQL_FILE = "stage.json"  # in OUT/<sql stage>: its fingerprint and row count


@dataclass
class StageStatus:
    name: str
    kind: str
    state: str  # complete, incomplete, running, not started, ...
    done: int | None = None  # requests (rows) written, for generate and score stages
    failed: int = 0
    remaining: int | None = None
    rows: int | None = None  # an sql stage's result

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.name, "kind": self.kind, "state": self.state, "done": self.done,
                "failed": self.failed, "remaining": self.remaining, "rows": self.rows}


def is_pipeline_directory(directory: Path) -> bool:
    return (Path(directory) / PIPELINE_FILE).is_file()


def pipeline_status(directory: Path) -> list[StageStatus]:
    """The stages of the pipeline last run into `directory`, in run order, with their progress."""
    data = read_json_or_none(Path(directory) / PIPELINE_FILE)
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
        raise CbgenError(f"'{directory / PIPELINE_FILE}' is not a pipeline's; run cbgen pipeline FILE -o {directory}")
    return [_stage_status(Path(directory) / s["name"], s["name"], s["kind"]) for s in data["stages"]]


def _stage_status(path: Path, name: str, kind: str) -> StageStatus:
    if not kind_of(kind).over_rows:  # a query's result, written whole
        stored = read_json_or_none(path / SQL_FILE)
        if isinstance(stored, dict) and stored.get("status") == "complete":
            return StageStatus(name, kind, "complete", rows=stored.get("rows"))
        return StageStatus(name, kind, "not started")
    from cbgen.outputs.collect import job_status

    try:
        directories = job_status(path)
    except CbgenError:
        return StageStatus(name, kind, "not started")
    states = {d.state for d in directories}
    state = "complete" if states == {"complete"} else "running" if "running" in states else \
        "not started" if states == {"not started"} else "incomplete"
    remaining = [d.remaining for d in directories]
    return StageStatus(name, kind, state, sum(d.done for d in directories), sum(d.failed for d in directories),
                       None if any(r is None for r in remaining) else sum(r or 0 for r in remaining))
