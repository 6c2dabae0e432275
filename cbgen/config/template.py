"""The commented YAML job file that `cbgen config init` writes, made from the sections' own defaults and help texts."""

from __future__ import annotations

import dataclasses
import textwrap

from cbgen.config.batching import BATCHING_FIELDS
from cbgen.config.sections import SECTIONS

_WIDTH = 110

_HEADER = """\
# cbgen job file. Precedence: built-in defaults < this file < command-line flags.
# Show the effective configuration with: cbgen config show --config THIS_FILE
"""

_BATCHING_NOTE = ("transformers' ContinuousBatchingConfig. Leave a key out to let cbgen or transformers decide; "
                  "uncomment one to set it.")


def _value(value: object) -> str:
    """A value as YAML writes it on one line (flow style for lists and mappings)."""
    import yaml  # only for `cbgen config template`: a command's help and a job start without it

    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH - len(indent) - 2, initial_indent=f"{indent}# ",
                         subsequent_indent=f"{indent}# ")


def config_template() -> str:
    """The template: every key of every section, with its default and what it means."""
    lines = [_HEADER]
    for section, kind in SECTIONS.items():
        lines.append(f"{section}:")
        if section == "batching":
            lines += _comment(_BATCHING_NOTE, "  ")
            for key, spec in BATCHING_FIELDS.items():
                lines += _comment(spec.help, "  ")
                lines.append(f"  # {key}: {_value(spec.default)}")
        else:
            for f in dataclasses.fields(kind):
                lines += _comment(f.metadata["help"], "  ")
                lines.append(f"  {f.name}: {_value(getattr(kind(), f.name))}")
        lines.append("")
    return "\n".join(lines)
