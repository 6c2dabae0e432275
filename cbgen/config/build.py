"""Building a job configuration: built-in defaults < YAML file < flags, validated before any model loads."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from cbgen.config.sections import SECTIONS, JobConfig
from cbgen.config.values import check_value
from cbgen.errors import CbgenError, first_line
from cbgen.kinds import DEFAULT, JOB_KINDS, kind_of


def read_yaml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Reads a job file into {section: {key: value}}, checking every key and value; errors name the file and line."""
    import yaml  # here: commands that read no job file (`cbgen --help`) do not pay for its import

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CbgenError(f"config file '{path}' does not exist; create one with `cbgen config init {path}`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CbgenError(f"config file '{path}' cannot be read: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or first_line(e)
        raise CbgenError(f"{path}{line}: YAML syntax error: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CbgenError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}")
    result: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if section not in SECTIONS:
            close = difflib.get_close_matches(str(section), list(SECTIONS), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise CbgenError(f"{path}: unknown section '{section}'; {hint}allowed: {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise CbgenError(f"{path}: section '{section}' must be a mapping of keys to values")
        result[section] = {
            key: check_value(section, key, value, f"{path}: {section}.{key}") for key, value in values.items()
        }
    return result


def build_config(
    config_file: str | Path | None = None, overrides: dict[tuple[str, str], tuple[Any, str]] | None = None,
    kind: str = DEFAULT,
) -> JobConfig:
    """Builds the effective configuration of a job of `kind` (one of cbgen.kinds.JOB_KINDS): defaults, then the YAML
    file, then `overrides`.

    `overrides` maps (section, key) to (value, flag name); only flags the user actually gave belong there.
    """
    layers: dict[str, dict[str, Any]] = read_yaml(config_file) if config_file else {}
    for (section, key), (value, flag) in (overrides or {}).items():
        layers.setdefault(section, {})[key] = check_value(section, key, value, flag)
    if kind not in JOB_KINDS:
        raise ValueError(f"a job is one of {', '.join(JOB_KINDS)}, not {kind!r}")  # the commands pass their own
    job = JobConfig(kind=kind)
    for section, values in layers.items():
        if section == "batching":
            job.batching.update(values)
        else:
            target = getattr(job, section)
            for key, value in values.items():
                setattr(target, key, value)
    if kind_of(kind).raw_prompts:  # its template makes a text, not a chat turn
        job.input.raw_prompts = True
    check_combinations(job)
    return job


def spelled(section: str, key: str, value: str | None = None) -> str:
    """A setting as the flag, the YAML key and the Python keyword spell it: messages that point at a way out name
    all three, as a job may come from any of them."""
    flag = f"--{key.replace('_', '-')}" + (f" {value}" if value is not None else "")
    yaml_key = f"{section}.{key}" + (f": {value}" if value is not None else "")
    python = f"{key}={value}" if value is not None else f"{key}="
    return f"{flag} (YAML {yaml_key}, Python {python})"


def check_combinations(job: JobConfig) -> None:
    """Rejects settings that are each valid but cannot go together, saying what to change."""
    kind_of(job.kind).check(job)
    g = job.generation
    sampling = [name for name in ("temperature", "top_p", "top_k") if getattr(g, name) is not None]
    if g.do_sample is False and [name for name in sampling if not (name == "temperature" and g.temperature == 0)]:
        given = ", ".join(spelled("generation", name) for name in sampling)
        raise CbgenError(f"greedy decoding ignores {given}: drop {spelled('generation', 'do_sample', 'false')} "
                         "or drop them")
    if g.do_sample is True and g.temperature == 0:
        raise CbgenError(f"temperature 0 is greedy decoding, and the job asks to sample: drop "
                         f"{spelled('generation', 'do_sample', 'true')}, or give a temperature above 0")
    if job.model.onednn_linear and job.model.linear_row_buckets:
        raise CbgenError("--onednn-linear and --linear-row-buckets are two ways to run the linear layers: use one")
    _check_adapters(job)
    r = job.run
    if r.redo and job.output.overwrite:
        raise CbgenError("--redo regenerates part of an earlier run, and --overwrite deletes it: give one")
    # a flag alone may be completed from the environment (cbgen.parallel.sharding.resolve_sharding); both must agree
    if r.num_shards is not None and r.shard_index is not None and r.shard_index >= r.num_shards:
        raise CbgenError(f"--shard-index {r.shard_index} must be below --num-shards {r.num_shards} (counted from 0)")
    if not kind_of(job.kind).generates:  # a job that generates nothing: what it scores is checked instead
        _check_scoring(job)
        return
    _check_format(job)
    if g.min_tokens is not None and g.min_tokens > g.max_new_tokens:
        raise CbgenError(f"{spelled('generation', 'min_tokens', str(g.min_tokens))} is more than "
                         f"{spelled('generation', 'max_new_tokens', str(g.max_new_tokens))}: lower it, or raise "
                         "the cap")
    if g.num_return_sequences > 1 and not job.do_sample:
        raise CbgenError(
            f"--num-return-sequences {g.num_return_sequences} needs sampling (greedy would return the same text "
            f"{g.num_return_sequences} times): give {spelled('generation', 'temperature')} above 0, or "
            f"{spelled('generation', 'num_return_sequences', '1')}"
        )


def _check_adapters(job: JobConfig) -> None:
    """Adapters where the job's kind and processes can run them (their folders are read with the job's plan)."""
    from cbgen.config.adapters import specs_of, split_spec

    specs = specs_of(job.model.adapter)
    if not specs:
        return
    kind = kind_of(job.kind)
    what = kind.command or f"a {job.kind} stage"
    if not kind.adapters:
        raise CbgenError(f"--adapter: {what} runs a model that cbgen does not merge LoRA adapters into; drop it")
    if kind.adapters == "job" and any(split_spec(s)[0] is not None for s in specs):
        raise CbgenError(f"--adapter NAME=PATH: in {what} every row runs with the job's one adapter (--adapter PATH); "
                         "rows pick adapters by name in cbgen run")
    if job.model.tp_size > 1 or job.run.data_parallel > 1:
        raise CbgenError("--adapter merges adapters into the one process's weights: drop --tp and --data-parallel, "
                         "and split a large input with --num-shards instead")


def _check_scoring(job: JobConfig) -> None:
    """What a job that generates nothing (score, embed, reward) cannot do: it runs in one process per shard and
    writes rows of its own kind."""
    command = kind_of(job.kind).command or f"a {job.kind} stage"
    if job.model.tp_size > 1 or job.run.data_parallel > 1:
        raise CbgenError(f"{command} runs one model per process: drop --tp and --data-parallel, and split a large "
                         "input with --num-shards instead")
    if job.output.format == "openai":
        raise CbgenError(f"--output-format openai holds generated choices, not {job.kind} rows: use jsonl or "
                         "parquet")
    if "length" in job.run.redo:
        raise CbgenError(f"--redo length applies to generated text cut by the token cap; {command} cuts nothing: "
                         "use --redo failed")
    if len(set(job.score.choices)) != len(job.score.choices) or any(c == "" for c in job.score.choices):
        raise CbgenError("--choices must be distinct, non-empty strings")
    for section in (job.embed, job.reward):
        if section.max_length is not None and section.max_length < 1:
            raise CbgenError(f"max_length must be at least 1, got {section.max_length}")
        if section.batch_tokens < 1:
            raise CbgenError(f"batch_tokens must be at least 1, got {section.batch_tokens}")


def _check_format(job: JobConfig) -> None:
    """A job-level output format (or response template) that cannot be used stops the job here, before any model
    loads."""
    g = job.generation
    if g.response_template is not None:
        from cbgen.chat.responses import load_template

        load_template(g.response_template)
    if g.json_schema is None and not g.json_object and g.regex is None and not g.choice and g.grammar is None \
            and g.response_format is None:
        return
    from cbgen.chat.formats import FormatError, check_format, job_format

    try:
        fmt = job_format(g)
    except FormatError as e:
        raise CbgenError(str(e)) from None
    if fmt is not None:
        flag = {"json_schema": "--json-schema", "json_object": "--json-object", "regex": "--regex",
                "choice": "--choice", "grammar": "--grammar"}[fmt.kind] if g.response_format is None \
            else "generation.response_format"
        try:
            check_format(fmt)
        except FormatError as e:
            raise CbgenError(f"{flag}: {e}") from None
