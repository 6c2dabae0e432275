"""Finished turns kept beside the shards (`turns.jsonl` in the run directory), so that a job killed mid-way loses
no turn it finished: a conversation is written as one row once it ends, and until then its turns live here.

Each line is one turn of one conversation, appended and flushed as the turn finishes (a `kill -9` keeps what the
operating system was handed; a line cut short by the kill is ignored when read). A resume replays each unwritten
conversation's turns (cbgen.conversations.state) and continues it. A complete run removes the file; `--overwrite`
removes it with the shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from cbgen.conversations.state import Turn
from cbgen.rows.rundir import TURNS_FILE


class TurnJournal:
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / TURNS_FILE
        self._file: IO[str] | None = None

    def read(self, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, list[Turn]]:
        """Each conversation's finished turns, in order, but those of the ids in `skip` (written already)."""
        found: dict[str, list[Turn]] = {}
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return found
        for line in lines:
            try:
                entry = json.loads(line)
                turn = Turn.from_dict(entry["turn"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
            if entry["id"] not in skip:
                found.setdefault(entry["id"], []).append(turn)
        return found

    def append(self, conversation_id: str, turn: Turn) -> None:
        if self._file is None:
            cut = self.path.exists() and self.path.stat().st_size > 0 and not self.path.read_bytes().endswith(b"\n")
            self._file = self.path.open("a", encoding="utf-8")
            if cut:  # a line cut short by a kill: what follows starts a line of its own
                self._file.write("\n")
        self._file.write(json.dumps({"id": conversation_id, "turn": turn.to_dict()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        """Every conversation is written: nothing is left to resume from."""
        self.close()
        self.path.unlink(missing_ok=True)
