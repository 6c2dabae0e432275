"""A row's own generation settings: which ones rows may carry, and their checks.

A row may set `temperature`, `top_p`, `top_k`, `max_new_tokens`, `stop`, `seed`, `top_logprobs` and
`response_format` (an OpenAI batch line's body also `n` and `logprobs`); each is checked here, before the engine
sees it, so a bad value becomes that row's error record instead of a failure inside the generation loop
(transformers checks only types, and raises or drops the rest).
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


def _temperature(value: Any) -> float | str:
    v = _number(value)
    return v if v is not None and v >= 0 else "a number >= 0 (0 = greedy)"


def _top_p(value: Any) -> float | str:
    v = _number(value)
    return v if v is not None and 0 < v <= 1 else "a number in (0, 1]"


def _top_k(value: Any) -> int | str:
    v = _integer(value)
    if v == -1:  # vLLM's spelling of "no limit"
        return 0
    return v if v is not None and v >= 0 else "an integer >= 0 (0 = no limit)"


def _max_new_tokens(value: Any) -> int | str:
    v = _integer(value)
    return v if v is not None and v >= 1 else "a positive integer"


def _n(value: Any) -> int | str:
    v = _integer(value)
    return v if v is not None and 1 <= v <= MAX_N else f"an integer from 1 to {MAX_N}"


def _stop(value: Any) -> tuple[str, ...] | str:
    items = [value] if isinstance(value, str) else value
    want = (f"a non-empty string of at most {MAX_STOP_CHARS} characters, or a list of at most {MAX_STOP_STRINGS} "
            "of them")
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
        return want
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items):
        return want
    return tuple(dict.fromkeys(items))


def _logprobs(value: Any) -> bool | str:
    return value if isinstance(value, bool) else "true or false"


def _top_logprobs(value: Any) -> int | str:
    v = _integer(value)
    return v if v is not None and 0 <= v <= MAX_TOP_LOGPROBS else f"an integer from 0 to {MAX_TOP_LOGPROBS}"


def _seed(value: Any) -> int | str:
    v = _integer(value)
    return v if v is not None else "an integer"


def _response_format(value: Any, field: str = "response_format") -> Any:
    """A ResponseFormat, or None for text; its own message names the part that is wrong."""
    from cbgen.formats import FormatError, parse_response_format

    try:
        return parse_response_format(value, field)
    except FormatError as e:
        raise RowError(str(e)) from None


CHECKS: dict[str, Callable[[Any], Any]] = {
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "max_new_tokens": _max_new_tokens,
    "stop": _stop,
    "n": _n,
    "logprobs": _logprobs,
    "top_logprobs": _top_logprobs,
    "seed": _seed,
    "response_format": _response_format,
}
# What a row of a plain file may set, by these field names. `n` and `logprobs` come only from OpenAI batch bodies,
# where their meaning is fixed: in a plain file they are too likely to be some other column of the user's.
ROW_SETTINGS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed", "top_logprobs", "response_format")
SAMPLING_SETTINGS = ("temperature", "top_p", "top_k")  # these need the engine's samplers to exist up front


def parse_settings(values: Mapping[str, Any], names: Mapping[str, str] | None = None,
                   keys: tuple[str, ...] = ROW_SETTINGS) -> dict[str, Any]:
    """Checks the settings `keys` in `values` (null means unset) and returns them normalised.

    `names` maps a setting to the field name the row used (an OpenAI body's `max_tokens`, say), for the message.
    Raises RowError naming the first bad field.
    """
    out: dict[str, Any] = {}
    for key in keys:
        check = CHECKS[key]
        value = values.get(key)
        if value is None:
            continue
        field = (names or {}).get(key, key)
        result = _response_format(value, field) if key == "response_format" else check(value)
        if result is None:  # a setting that says "none" (a response_format of type text)
            continue
        if isinstance(result, str):  # a check returns what the value must be when it is wrong
            raise RowError(f"{field!r} must be {result}, got {_show(value)}")
        out[key] = result
    return out


def _show(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    return describe_type(value)
