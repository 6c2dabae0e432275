"""The kinds of stage, one module each (cbgen.kinds.base says what a kind answers): the only place that tells one
kind from another by name. `cbgen run` is a generate job, `cbgen score` a score job; a pipeline's stages may be any
of them.

Adding a kind: a module here with its Kind subclass, one line in KINDS, its docs and its tests.
"""

from __future__ import annotations

from cbgen.errors import CbgenError
from cbgen.kinds.base import EncoderKind, Kind
from cbgen.kinds.chat import Chat
from cbgen.kinds.dedup import Dedup
from cbgen.kinds.embed import Embed
from cbgen.kinds.generate import Generate
from cbgen.kinds.reward import Reward
from cbgen.kinds.score import Score
from cbgen.kinds.sql import Sql

KINDS: dict[str, Kind] = {kind.name: kind for kind in (Generate(), Score(), Embed(), Reward(), Chat(), Sql(),
                                                       Dedup())}
JOB_KINDS = tuple(name for name, kind in KINDS.items() if kind.over_rows)  # what a cbgen job may be
DEFAULT = "generate"  # a job's kind when nothing says otherwise (cbgen run; rows written before kinds were stored)
OWN_SECTIONS = frozenset(kind.own_section for kind in KINDS.values() if kind.own_section)


def kind_of(name: str | None) -> Kind:
    """The kind called `name` (the default kind for None or an empty name)."""
    found = KINDS.get(name or DEFAULT)
    if found is None:
        raise CbgenError(f"unknown kind {name!r}; the kinds are: {', '.join(KINDS)}")
    return found


def kind_of_columns(names: set[str] | frozenset[str]) -> Kind:
    """The kind whose rows have these column names (rows written before cbgen stored their kind)."""
    return next((kind for kind in KINDS.values() if kind.identifies(names)), KINDS[DEFAULT])


__all__ = ["DEFAULT", "JOB_KINDS", "KINDS", "OWN_SECTIONS", "EncoderKind", "Kind", "kind_of", "kind_of_columns"]
