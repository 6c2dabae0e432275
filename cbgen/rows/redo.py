"""`--redo failed,length`: regenerate, in an existing output directory, only the requests whose record is an error,
or was cut by the token cap, with the job's current generation settings.

A redo takes those requests' rows out of the committed shards (each shard rewritten whole and renamed over itself),
then the run goes on as a resume: the requests now missing are generated again, with the new settings, and written
once. So every id is in the shards exactly once throughout, with its latest answer, and a redo killed at any point
is finished by running the same command again: a redo whose settings match an unfinished one in the history resumes
it instead of starting another. The history (`redos` in fingerprint.json, copied into run.json) says which redo
ran, when, with what generation settings, and how many requests and rows it took out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cbgen.rows.shards import read_shard, take_out

REDO_KINDS = {"failed": "error", "length": "length"}  # what --redo names -> the finish_reason it takes


def start_redo(shards: list[tuple[int, Path]], data: dict[str, Any], fingerprint: dict[str, Any],
               kinds: Sequence[str]) -> dict[str, Any]:
    """The first half of a redo on a locked directory whose committed shards are `shards` (cbgen.rows.shards.settle)
    and whose fingerprint.json holds `data`: unless it resumes an unfinished redo with the same generation settings,
    it takes the requests to redo out of the shards. Returns what fingerprint.json must hold now (the new generation
    settings, the redo in the history)."""
    history: list[dict[str, Any]] = list(data.get("redos") or [])
    last = history[-1] if history else None
    generation = fingerprint.get("generation", {})
    if last is not None and not last.get("finished") and last.get("generation") == generation \
            and last.get("redo") == sorted(kinds):
        return data  # the same redo, stopped part-way: the run resumes it
    # the requests with a sequence whose finish_reason is one of `kinds`; a score row (which has no finish_reason)
    # failed when it has an error
    reasons = {REDO_KINDS[kind] for kind in kinds}
    ids = {row["id"] for _, path in shards for row in read_shard(path, columns=["id", "finish_reason", "error"])
           if row.get("finish_reason", "error" if row.get("error") is not None else None) in reasons}
    rows = take_out(shards, ids)
    history.append({"redo": sorted(kinds), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "generation": generation, "changed": _changed(data.get("fingerprint", {}).get("generation", {}),
                                                                  generation),
                    "requests": len(ids), "rows": rows, "finished": False})
    return data | {"fingerprint": fingerprint, "redos": history}


def finish_redo(data: dict[str, Any]) -> dict[str, Any]:
    """fingerprint.json's contents `data` with the last redo marked finished (its run has every request written)."""
    history = list(data.get("redos") or [])
    if history and not history[-1].get("finished"):
        history[-1] = history[-1] | {"finished": True, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return data | {"redos": history}


def _changed(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    return {key: [old.get(key), new.get(key)] for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}
