"""A row's own generation settings: which ones rows may carry, and their checks.

A row may set `temperature`, `top_p`, `top_k`, `max_new_tokens`, `stop`, `seed`, `top_logprobs`, `response_format`
and the history controls (`repetition_penalty`, `presence_penalty`, `frequency_penalty`, `no_repeat_ngram_size`,
`min_p`, `min_tokens`, `logit_bias`, `bad_words`, `ignore_eos`), the LoRA adapter that answers it (`adapter`: a
name the job gives with --adapter NAME=PATH; an OpenAI batch line's body names it as its `model`), and an OpenAI
batch line's body also `n` and `logprobs`; each is checked here, before the engine sees it, so a bad value becomes
that row's error record instead of a failure inside the generation loop (transformers checks only types, and raises
or drops the rest).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from cbgen.errors import RowError, describe_type

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # each stop string is searched for in a window of recent text on every step
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_BAD_WORDS = 64


def _invalid(field: str, value: Any, want: str) -> RowError:
    return RowError(f"{field!r} must be {want}, got {_show(value)}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None


def _temperature(value: Any, field: str) -> float:
    v = _number(value)
    if v is None or v < 0:
        raise _invalid(field, value, "a number >= 0 (0 = greedy)")
    return v


def _top_p(value: Any, field: str) -> float:
    v = _number(value)
    if v is None or not 0 < v <= 1:
        raise _invalid(field, value, "a number in (0, 1]")
    return v


def _top_k(value: Any, field: str) -> int:
    v = _integer(value)
    if v == -1:  # vLLM's spelling of "no limit"
        return 0
    if v is None or v < 0:
        raise _invalid(field, value, "an integer >= 0 (0 = no limit)")
    return v


def _max_new_tokens(value: Any, field: str) -> int:
    v = _integer(value)
    if v is None or v < 1:
        raise _invalid(field, value, "a positive integer")
    return v


def _n(value: Any, field: str) -> int:
    v = _integer(value)
    if v is None or not 1 <= v <= MAX_N:
        raise _invalid(field, value, f"an integer from 1 to {MAX_N}")
    return v


def _stop(value: Any, field: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS \
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items):
        raise _invalid(field, value, f"a non-empty string of at most {MAX_STOP_CHARS} characters, or a list of at "
                                     f"most {MAX_STOP_STRINGS} of them")
    return tuple(dict.fromkeys(items))


def _boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise _invalid(field, value, "true or false")
    return value


def _top_logprobs(value: Any, field: str) -> int:
    v = _integer(value)
    if v is None or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise _invalid(field, value, f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    return v


def _seed(value: Any, field: str) -> int:
    v = _integer(value)
    if v is None:
        raise _invalid(field, value, "an integer")
    return v


def _penalty(value: Any, field: str) -> float:
    v = _number(value)
    if v is None or not -2 <= v <= 2:
        raise _invalid(field, value, "a number from -2 to 2 (OpenAI's range; 0 = off)")
    return v


def _repetition_penalty(value: Any, field: str) -> float:
    v = _number(value)
    if v is None or v <= 0:
        raise _invalid(field, value, "a number above 0 (1 = off; above 1 discourages repeats)")
    return v


def _min_p(value: Any, field: str) -> float:
    v = _number(value)
    if v is None or not 0 <= v <= 1:
        raise _invalid(field, value, "a number in [0, 1] (0 = off)")
    return v


def _count(value: Any, field: str) -> int:
    v = _integer(value)
    if v is None or v < 0:
        raise _invalid(field, value, "an integer >= 0 (0 = off)")
    return v


def _logit_bias(value: Any, field: str) -> dict[int, float]:
    """OpenAI's logit_bias: token id (a JSON key, so a string of digits) -> a bias from -100 to 100."""
    if not isinstance(value, dict):
        raise _invalid(field, value, "an object of token id -> bias from -100 to 100")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _integer(key) if not isinstance(key, str) else (int(key) if key.strip().isdigit() else None)
        number = _number(bias)
        if token is None or token < 0 or number is None or not -100 <= number <= 100:
            raise RowError(f"{field!r} must map token ids (integers >= 0) to biases from -100 to 100, got "
                           f"{key!r}: {_show(bias)}")
        out[token] = number
    return out


def _bad_words(value: Any, field: str) -> list[str | list[int]]:
    """vLLM's bad_words (strings) and transformers' bad_words_ids (token-id sequences), in one list."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_BAD_WORDS:
        raise _invalid(field, value, f"a list of at most {MAX_BAD_WORDS} strings or token-id lists")
    for item in items:
        ids = isinstance(item, list) and item and all((_integer(t) or 0) >= 0 and _integer(t) is not None
                                                      for t in item)
        if not (isinstance(item, str) and 0 < len(item) <= MAX_STOP_CHARS) and not ids:
            raise RowError(f"{field!r} items must be non-empty strings (at most {MAX_STOP_CHARS} characters) or "
                           f"non-empty lists of token ids, got {_show(item) if item != '' else 'an empty string'}")
    return [item if isinstance(item, str) else [int(t) for t in item] for item in items]


def _name(value: Any, field: str) -> str:
    """An adapter's name (cbgen.model.adapters): which of the job's adapters runs the row. Whether the job has one
    of that name is checked when the row is prepared (cbgen.job.request_settings)."""
    if not isinstance(value, str) or not value.strip():
        raise _invalid(field, value, "the name of one of the job's adapters (--adapter NAME=PATH)")
    return value


def _response_format(value: Any, field: str) -> Any:
    """A ResponseFormat, or None for text; its own message names the part that is wrong."""
    from cbgen.chat.formats import FormatError, parse_response_format

    try:
        return parse_response_format(value, field)
    except FormatError as e:
        raise RowError(str(e)) from None


# Each check takes the value and the field name the row used, and returns the value normalised (None: the setting
# says "none", as a response_format of type text does) or raises RowError naming the field and what it must be.
CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "max_new_tokens": _max_new_tokens,
    "stop": _stop,
    "n": _n,
    "logprobs": _boolean,
    "top_logprobs": _top_logprobs,
    "seed": _seed,
    "response_format": _response_format,
    "repetition_penalty": _repetition_penalty,
    "presence_penalty": _penalty,
    "frequency_penalty": _penalty,
    "no_repeat_ngram_size": _count,
    "min_p": _min_p,
    "min_tokens": _count,
    "logit_bias": _logit_bias,
    "bad_words": _bad_words,
    "ignore_eos": _boolean,
    "adapter": _name,
}
# What a row of a plain file may set, by these field names. `n` and `logprobs` come only from OpenAI batch bodies,
# where their meaning is fixed: in a plain file they are too likely to be some other column of the user's.
# the history controls (cbgen.control.penalties): the step control applies them
CONTROL_SETTINGS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "no_repeat_ngram_size", "min_p",
                    "min_tokens", "logit_bias", "bad_words", "ignore_eos")
ROW_SETTINGS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed", "top_logprobs", "response_format",
                *CONTROL_SETTINGS, "adapter")
SAMPLING_SETTINGS = ("temperature", "top_p", "top_k")  # these need the engine's samplers to exist up front


def row_settings(adapters: bool) -> tuple[str, ...]:
    """The fields a job's rows set: `adapter` picks a row's adapter only in a job that declares adapters (elsewhere
    it is a column like any other, which the row may carry for its own reasons)."""
    return ROW_SETTINGS if adapters else tuple(name for name in ROW_SETTINGS if name != "adapter")


def parse_settings(values: Mapping[str, Any], names: Mapping[str, str] | None = None,
                   keys: tuple[str, ...] = ROW_SETTINGS) -> dict[str, Any]:
    """Checks the settings `keys` in `values` (null means unset) and returns them normalised.

    `names` maps a setting to the field name the row used (an OpenAI body's `max_tokens`, say), for the message.
    Raises RowError naming the first bad field.
    """
    out: dict[str, Any] = {}
    for key in keys:
        value = values.get(key)
        if value is None:
            continue
        result = CHECKS[key](value, (names or {}).get(key, key))
        if result is not None:
            out[key] = result
    return out


def _show(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    return describe_type(value)
