"""A job's settings by their YAML keys alone, without sections: what the Python API takes as keyword arguments and
a pipeline's stages take as keys (`max_new_tokens`, `template`, `page_size`, `choices`, ...). The two `format` keys
are `input_format` and `output_format`; the input path and output directory are given otherwise."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import fields
from functools import cache
from typing import Any

from cbgen.config.batching import BATCHING_FIELDS
from cbgen.config.sections import SECTIONS

RENAMED = {"input_format": ("input", "format"), "output_format": ("output", "format")}
NOT_FLAT = {("input", "path"), ("output", "dir")}  # given as arguments (the API) or by the pipeline


@cache
def flat_keys(own_section: str | None = None) -> dict[str, tuple[str, str]]:
    """Every flat key, with its (section, key). Kinds' own sections share some names (`batch_tokens`,
    `text_column`, `completion_column`, `max_length`): such a name is `own_section`'s where that section has it
    (the section of the job's or stage's kind, cbgen.kinds.Kind.own_section), else the last section's."""
    found: dict[str, tuple[str, str]] = dict(RENAMED)
    for section, kind in SECTIONS.items():
        names = BATCHING_FIELDS if section == "batching" else [f.name for f in fields(kind)]
        for name in names:
            if (section, name) not in NOT_FLAT and name != "format":
                found[name] = (section, name)
    if own_section is not None:
        found |= {f.name: (own_section, f.name) for f in fields(SECTIONS[own_section])}
    return found


def closest(name: str, choices: Collection[str]) -> str:
    """'; did you mean X?' for the choice closest to a mistyped `name`, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def flat_overrides(settings: Mapping[str, Any], where: str = "", own_section: str | None = None
                   ) -> dict[tuple[str, str], tuple[Any, str]]:
    """Overrides for build_config from flat keys whose names are known (callers check them first), a shared name
    taken as `own_section`'s (flat_keys); each value is checked later under the name `where` + key."""
    keys = flat_keys(own_section)
    return {keys[name]: (value, f"{where}{name}") for name, value in settings.items()}


def keyword_overrides(settings: Mapping[str, Any], allowed: set[str] | None = None, why: str = "",
                      own_section: str | None = None) -> dict[tuple[str, str], tuple[Any, str]]:
    """Overrides from the Python API's keyword arguments, each checked to be a flat key (of a section in `allowed`,
    when given; a shared name taken as `own_section`'s): an unknown one is a TypeError naming it, the closest known
    key, and `why` when the key exists but is not taken here."""
    keys = flat_keys(own_section)
    for name in settings:
        if name not in keys or (allowed is not None and keys[name][0] not in allowed):
            choices = [k for k in keys if allowed is None or keys[k][0] in allowed]
            raise TypeError(f"unexpected keyword argument {name!r}{why if name in keys else ''}"
                            f"{closest(name, choices)}")
    return flat_overrides(settings, own_section=own_section)
