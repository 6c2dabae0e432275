"""How a job names its LoRA adapters in the setting `model.adapter`: `PATH` (or a hub id) for the job's own adapter,
`NAME=PATH` for one that rows pick by name; one string, or a list. Only the form is checked here; the adapters
themselves are found, read and checked against the model by cbgen.model.adapters."""

from __future__ import annotations

import re
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")  # a name rows may give (OpenAI model names included)


def specs_of(value: str | list[str] | None) -> list[str]:
    """The setting `model.adapter` as a list: a string is one adapter; a list gives several."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def split_spec(spec: str) -> tuple[str | None, str]:
    """`NAME=PATH` -> (NAME, PATH); a PATH (or hub id) alone -> (None, PATH). An existing path is never split."""
    name, sep, rest = spec.partition("=")
    if sep and NAME.match(name) and rest and not Path(spec).expanduser().exists():
        return name, rest
    return None, spec


def check_specs(value: str | list[str]) -> bool:
    """The setting's form: non-empty entries, at most one without a name, no name twice."""
    specs = specs_of(value)
    parts = [split_spec(s) for s in specs]
    names = [n for n, _ in parts if n is not None]
    return all(p.strip() for _, p in parts) and sum(n is None for n, _ in parts) <= 1 and len(names) == len(set(names))
