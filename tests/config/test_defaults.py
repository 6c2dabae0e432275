"""One source for defaults: the config dataclasses (and the ContinuousBatchingConfig table) feed the flag help and
the YAML template, and the table matches the installed transformers."""

from __future__ import annotations

import dataclasses

import yaml

from cbgen.cli import load_command
from cbgen.cli._options import JOB_OPTIONS
from cbgen.config import BATCHING_FIELDS, BATCHING_REDIRECTS, SECTIONS, JobConfig, config_template


def flag_help() -> dict[str, str]:
    """The help text of every option of `cbgen run`, as click holds it."""
    command = load_command("run", literal=False)
    return {param.opts[0]: param.help or "" for param in command.params if param.opts[0].startswith("--")}


def test_the_flags_show_the_dataclass_defaults():
    helps = flag_help()
    job = JobConfig()
    checked = 0
    for option in JOB_OPTIONS:
        flag = option.flags[0].split("/")[0]
        if option.section == "batching":
            default = BATCHING_FIELDS[option.key].default
        else:
            default = getattr(getattr(job, option.section), option.key)
        if default is None or default == []:
            assert "[default:" not in helps[flag], flag
            continue
        if isinstance(default, bool):
            on, _, off = option.flags[0].partition("/")
            shown = on if default else off
        else:
            shown = str(default)
        assert helps[flag].endswith(f"[default: {shown}]"), (flag, helps[flag])
        checked += 1
    assert checked >= 20


def test_the_flags_and_the_template_say_the_same():
    """Each flag's help starts with the very text the template writes above its key."""
    template = config_template()
    helps = flag_help()
    for option in JOB_OPTIONS:
        text = helps[option.flags[0].split("/")[0]].split("  [default:")[0].removesuffix(" Repeatable.")
        first_words = " ".join(text.split()[:8])
        assert first_words in " ".join(line.strip("# ") for line in template.splitlines()), option.key


def test_the_template_holds_every_key_with_its_default():
    data = yaml.safe_load(config_template())
    assert data | {"batching": {}} == JobConfig().to_dict()
    for section, kind in SECTIONS.items():
        if kind is not dict:
            assert list(data[section]) == [f.name for f in dataclasses.fields(kind)]
    for key, spec in BATCHING_FIELDS.items():  # commented out, with transformers' default
        shown = yaml.safe_dump(spec.default, default_flow_style=True).strip().removesuffix("...").strip()
        assert f"  # {key}: {shown}" in config_template()


def test_the_batching_table_matches_the_installed_transformers():
    from transformers.generation import ContinuousBatchingConfig

    fields = {f.name: f for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert set(fields) == set(BATCHING_FIELDS) | set(BATCHING_REDIRECTS)
    assert not set(BATCHING_FIELDS) & set(BATCHING_REDIRECTS)
    for name, spec in BATCHING_FIELDS.items():
        assert spec.default == fields[name].default, name


def test_the_help_names_every_random_weight_shape():
    from cbgen.model.source import RANDOM_SHAPES

    helps = flag_help()
    assert all(name in helps["--model"] for name in RANDOM_SHAPES)
