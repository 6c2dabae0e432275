"""How a setting is declared: a dataclass field that carries its help text (the command-line help and the YAML
template are made from it)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, help: str) -> Any:
    """A dataclass field with its help text; a list or dict default gets a fresh one per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
