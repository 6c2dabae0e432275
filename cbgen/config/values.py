"""Checking one configuration value: its type (only lossless conversions) and its range, with a message that names
where it came from: the YAML file and key (`job.yaml: batching.page_size ...`) or the flag (`--page-size ...`)."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal, get_args, get_origin

from cbgen.config.batching import BATCHING_FIELDS, BATCHING_REDIRECTS, SCHEDULERS
from cbgen.config.sections import SECTIONS
from cbgen.errors import CbgenError


def _bias_ok(value: dict) -> bool:
    try:
        return all(int(k) >= 0 and isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100
                   for k, b in value.items())
    except (TypeError, ValueError):
        return False


def _adapters_ok(value: str | list[str]) -> bool:
    from cbgen.config.adapters import check_specs

    return check_specs(value)


def _regex_ok(value: str) -> bool:
    import re

    try:
        re.compile(value)
    except re.error:
        return False
    return value != ""


# Range checks beyond the type: (predicate, what the value must be).
_CHECKS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "model.cache_dir": (lambda v: v.strip() != "", "a directory path"),
    "model.adapter": (lambda v: _adapters_ok(v), "an adapter folder or hub id (PATH), or NAME=PATH; at most one "
                      "without a name, and each name once"),
    "model.tp_size": (lambda v: v >= 1, "a positive integer (the number of processes torchrun starts)"),
    "batching.page_size": (lambda v: v >= 4, "an integer of at least 4"),
    "batching.num_blocks": (lambda v: v >= 1, "a positive integer"),
    "batching.max_batch_tokens": (lambda v: v >= 1, "a positive integer"),
    "batching.max_requests_per_batch": (lambda v: v >= 1, "a positive integer"),
    "batching.max_blocks_per_request": (lambda v: v >= 0, "an integer of at least 0 (0 turns the fast path off)"),
    "batching.max_memory_percent": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "batching.safety_margin": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "batching.default_compile_level": (lambda v: 0 <= v <= 3, "an integer from 0 to 3"),
    "batching.cpu_offload_space": (lambda v: v >= 0, "a size in GiB, at least 0"),
    "batching.cpu_offload_space_safety_threshold": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "batching.max_queue_size": (lambda v: v >= 0, "an integer of at least 0 (0 = unlimited)"),
    "batching.q_padding_interval_size": (lambda v: v >= 0, "an integer of at least 0"),
    "batching.kv_padding_interval_size": (lambda v: v >= 0, "an integer of at least 0"),
    "batching.cpu_group_timeout": (lambda v: v > 0, "a positive number of seconds"),
    "batching.scheduler_type": (lambda v: v in SCHEDULERS, "one of: fifo, prefill_first"),
    "generation.max_new_tokens": (lambda v: v >= 1, "a positive integer"),
    "input.max_render_chars": (lambda v: v >= 1, "a positive number of characters"),
    "input.render_timeout": (lambda v: v > 0, "a positive number of seconds"),
    "generation.temperature": (lambda v: v >= 0, "a number >= 0 (0 is greedy: the most likely token)"),
    "generation.top_p": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "generation.top_k": (lambda v: v >= 1, "a positive integer"),
    "generation.num_return_sequences": (lambda v: v >= 1, "a positive integer"),
    "generation.stop_token_ids": (lambda v: all(t >= 0 for t in v), "a list of token ids (integers >= 0)"),
    "generation.stop": (lambda v: all(s != "" for s in v), "a list of non-empty strings"),
    "generation.top_logprobs": (lambda v: 1 <= v <= 20, "an integer from 1 to 20"),
    "generation.repetition_penalty": (lambda v: v > 0, "a number above 0 (1 = off)"),
    "generation.presence_penalty": (lambda v: -2 <= v <= 2, "a number from -2 to 2"),
    "generation.frequency_penalty": (lambda v: -2 <= v <= 2, "a number from -2 to 2"),
    "generation.no_repeat_ngram_size": (lambda v: v >= 1, "a positive integer"),
    "generation.min_p": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "generation.min_tokens": (lambda v: v >= 0, "an integer of at least 0"),
    "generation.logit_bias": (_bias_ok, 'a JSON object of token id -> bias from -100 to 100, such as {"50256": -100}'),
    "generation.bad_words": (lambda v: all(s != "" for s in v), "a list of non-empty strings"),
    "generation.loop_stop": (lambda v: v >= 2, "an integer of at least 2 (repeats of one span)"),
    "generation.loop_stop_span": (lambda v: 1 <= v <= 512, "an integer from 1 to 512"),
    "generation.regex": (lambda v: v != "", "a regular expression"),
    "generation.json_schema": (lambda v: v.strip() != "", "a JSON schema file or inline JSON"),
    "generation.grammar": (lambda v: v.strip() != "", "a grammar file"),
    "generation.choice": (lambda v: all(s != "" for s in v), "a list of non-empty strings"),
    "generation.chat_template_kwargs": (lambda v: all(isinstance(k, str) for k in v),
                                        'a JSON object of chat template variables, such as {"enable_thinking": false}'),
    "generation.response_template": (lambda v: v.strip() != "", "a response template file (JSON), or think"),
    "input.split": (lambda v: v.strip() != "", "a split name such as train"),
    "input.subset": (lambda v: v.strip() != "", "a configuration name"),
    "input.max_line_bytes": (lambda v: v >= 1024, "a number of bytes, at least 1024"),
    "input.template": (lambda v: v.strip() not in ("", "@"), "a template (text), or @FILE"),
    "input.system": (lambda v: v.strip() not in ("", "@"), "a template (text), or @FILE"),
    "score.batch_tokens": (lambda v: v >= 16, "a number of tokens, at least 16"),
    "score.completion_column": (lambda v: v.strip() != "", "a field name"),
    "score.text_column": (lambda v: v.strip() != "", "a field name"),
    "chat.max_turns": (lambda v: v >= 1, "a positive integer (assistant replies per conversation)"),
    "chat.user_turns_column": (lambda v: v.strip() != "", "a field name"),
    "chat.user_template": (lambda v: v.strip() not in ("", "@"), "a template (text), or @FILE"),
    "chat.user_system": (lambda v: v.strip() not in ("", "@"), "a template (text), or @FILE"),
    "chat.user_stop": (_regex_ok, "a regular expression (Python's re syntax)"),
    "chat.user_temperature": (lambda v: v >= 0, "a number >= 0 (0 is greedy)"),
    "chat.user_max_new_tokens": (lambda v: v >= 1, "a positive integer"),
    "output.rows_per_shard": (lambda v: v >= 1, "a positive integer"),
    "run.max_in_flight": (lambda v: v >= 1, "a positive integer"),
    "run.request_timeout": (lambda v: v > 0, "a positive number of seconds"),
    "run.max_errors": (lambda v: v >= 0, "an integer of at least 0"),
    "run.commit_interval": (lambda v: v > 0, "a positive number of seconds"),
    "run.num_shards": (lambda v: v >= 1, "a positive integer"),
    "run.data_parallel": (lambda v: v >= 1, "a positive integer (engine processes)"),
    "run.shard_index": (lambda v: v >= 0, "an integer of at least 0"),
    "run.cache": (lambda v: v.strip() != "", "a directory path"),
    "run.cache_max_size": (lambda v: v > 0, "a size in gigabytes, above 0 (0.5 is 500 MB)"),
}


def describe_annotation(tp: Any) -> str:
    """A short, human name for a type annotation ("integer", "one of: jsonl, parquet", "a list of texts")."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        parts = [describe_annotation(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(parts)
    if origin is list:
        return f"a list of {describe_annotation(get_args(tp)[0])}s"
    if origin is tuple:
        return "a pair of booleans"
    return {int: "integer", float: "number", bool: "true/false", str: "text"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any) -> Any:
    """Returns `value` as type `tp`, or raises ValueError. Only lossless conversions (an int where a float goes)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        for arg in get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except ValueError:
                pass
        raise ValueError
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ValueError
    if origin is list:
        if not isinstance(value, list):
            raise ValueError
        return [_coerce(v, get_args(tp)[0]) for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(isinstance(v, bool) for v in value):
            raise ValueError
        return tuple(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError
    if tp is dict:
        if isinstance(value, str):  # from a flag: a JSON object
            import json

            value = json.loads(value)  # a ValueError when it is not JSON
        if isinstance(value, dict):
            return value
        raise ValueError
    raise ValueError


def _field_types(section: str) -> dict[str, Any]:
    if section == "batching":
        return {name: f.type for name, f in BATCHING_FIELDS.items()}
    return typing.get_type_hints(SECTIONS[section])


def check_value(section: str, key: str, value: Any, where: str) -> Any:
    """Validates one value and returns it normalised. `where` prefixes the message: 'job.yaml: batching.page_size'
    or '--page-size'."""
    types_ = _field_types(section)
    if section == "batching" and key in BATCHING_REDIRECTS:
        raise CbgenError(f"{where}: {BATCHING_REDIRECTS[key]}")
    if key not in types_:
        allowed = sorted(k for k in types_ if k not in BATCHING_REDIRECTS)
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise CbgenError(f"{where}: unknown key '{key}' in section '{section}'; {hint}allowed: {', '.join(allowed)}")
    if section == "batching" and key == "scheduler_type" and isinstance(value, str):
        value = value.replace("-", "_")
    tp = types_[key]
    try:
        value = _coerce(value, tp)
    except ValueError:
        check = _CHECKS.get(f"{section}.{key}")
        expected = check[1] if check else describe_annotation(tp)
        raise CbgenError(f"{where} must be {expected} (got {value!r})") from None
    check = _CHECKS.get(f"{section}.{key}")
    if check and value is not None and not check[0](value):
        raise CbgenError(f"{where} must be {check[1]} (got {value!r})")
    return value
