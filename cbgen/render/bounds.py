"""How large a value a template operation is about to build, worked out from its arguments before it runs.

The sandbox (cbgen.render.sandbox) refuses a row whose template would build more than its budget. Most operations
can only make what they are given a little larger, and their results are measured after they run; these can make it
many times larger in one step, so their size is known first: `replace` (each occurrence grows by the replacement),
`join` (a separator between every two items), `indent` and `wordwrap` (something added to every line), `center`,
`format` and `%` (widths in the format string), `batch` and `slice` (filled to a count), `sum` (lists or strings
added up), `list`, `lipsum` (paragraphs of words), and the string methods that do the same (`replace`, `join`,
`center`, `ljust`, `rjust`, `zfill`, `expandtabs`, `format`). Each answer is an upper bound of the result's length in
characters (or items), cheap to compute from values that already exist.
"""

from __future__ import annotations

import functools
import inspect
import re
import string
from collections.abc import Callable, Mapping, Sized
from typing import Any

_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_DIGITS = re.compile(r"\d+")


def size_of(value: Any) -> int | None:
    """A built value's length in characters or items, where it has one."""
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else None


def _length(value: Any) -> int:
    return len(value) if isinstance(value, Sized) else 0


def _text(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _shown(value: Any) -> int:
    """About how many characters a value takes when formatted (without making its text: a large int's would be
    slow), as far as it can make the result large: strings, numbers; other values are measured once built."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return int(abs(value).bit_length() * 0.302) + 2
    return 32 if isinstance(value, float) else 0


def _numbers(values: Any) -> int:
    """The sum of the integer arguments (widths a format takes from its arguments)."""
    return sum(abs(_int(v)) for v in values)


def percent_size(text: str, values: Any) -> int:
    """`text % values`: the format's own characters, each field's width and precision, and the values' text."""
    items = values if isinstance(values, tuple) else \
        tuple(values.values()) if isinstance(values, Mapping) else (values,)
    widths = sum(int(n) for match in _PERCENT.finditer(text) for n in match.groups() if n and n != "*")
    return len(text) + widths + _numbers(items) + sum(map(_shown, items))


def format_size(text: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """`text.format(*args, **kwargs)`: the same for str.format's fields."""
    widths = 0
    try:
        fields = list(string.Formatter().parse(text))
    except ValueError:
        fields = []
    for _, _, spec, _ in fields:
        widths += sum(int(n) for n in _DIGITS.findall(spec or ""))
    values = (*args, *kwargs.values())
    return len(text) + widths + _numbers(values) + sum(map(_shown, values))


def _replace(s: Any, old: Any, new: Any, count: Any = None) -> int:
    s, old, new = str(s), str(old), str(new)
    occurrences = s.count(old) if old else len(s) + 1
    count = _int(count, -1)
    if count >= 0:
        occurrences = min(occurrences, count)
    return len(s) + occurrences * max(len(new) - len(old), 0)


def _join(items: Any, separator: Any) -> int:
    if not isinstance(items, (str, list, tuple, dict, set, frozenset)):
        return 0  # an iterator: its items are measured as the result is
    return max(len(items) - 1, 0) * len(str(separator)) + sum(_text(item) for item in items)


def _lines(s: Any) -> int:
    return str(s).count("\n") + 1


def _indent(s: Any, width: Any = 4, *_: Any) -> int:
    added = len(width) if isinstance(width, str) else _int(width)
    return len(str(s)) + _lines(s) * added


def _wordwrap(s: Any, width: Any = 79, wrapstring: Any = None) -> int:
    text = str(s)
    lines = len(text) // max(_int(width, 79), 1) + _lines(text)
    return len(text) + lines * len(wrapstring if isinstance(wrapstring, str) else "\n")


def _filled(value: Any, count: Any) -> int:
    """batch and slice: the items, and up to `count` more (the fill, or the lists themselves)."""
    return _length(value) + abs(_int(count))


def _sum(iterable: Any, start: Any = 0) -> int:
    if isinstance(start, (str, list, tuple)) and isinstance(iterable, (list, tuple)):
        return len(start) + sum(_length(item) for item in iterable)
    return 0


def _lipsum(*args: Any, **kwargs: Any) -> int:
    """lipsum(n=5, html=True, min=20, max=100): n paragraphs of at most `max` words, each at most 12 letters with a
    space and markup."""
    values = dict(zip(("n", "html", "min", "max"), args)) | kwargs
    return abs(_int(values.get("n"), 5)) * abs(_int(values.get("max"), 100)) * 16


# filter name -> (its parameters as jinja names them, read from the call) -> the result's largest size
FILTERS: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "replace": lambda a: _replace(a.get("s", ""), a.get("old", ""), a.get("new", ""), a.get("count")),
    "join": lambda a: _join(a.get("value", ()), a.get("d", "")),
    "center": lambda a: max(len(str(a.get("value", ""))), _int(a.get("width", 80))),
    "indent": lambda a: _indent(a.get("s", ""), a.get("width", 4)),
    "wordwrap": lambda a: _wordwrap(a.get("s", ""), a.get("width", 79), a.get("wrapstring")),
    "format": lambda a: percent_size(str(a.get("value", "")), tuple(a.get("args", ())) or dict(a.get("kwargs", {}))),
    "batch": lambda a: _filled(a.get("value", ()), a.get("linecount", 0)),
    "slice": lambda a: _filled(a.get("value", ()), a.get("slices", 0)),
    "list": lambda a: _length(a.get("value", ())),
    "sum": lambda a: _sum(a.get("iterable", ()), a.get("start", 0)),
}


@functools.cache
def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def filter_size(name: str, function: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
                ) -> int | None:
    """The largest result the filter `name` (jinja's `function`) can give for these arguments, where it can grow
    its input many times over; None for the others (their results are measured once built)."""
    predict = FILTERS.get(name)
    signature = _signature(function) if predict is not None else None
    if predict is None or signature is None:
        return None
    first = next(iter(signature.parameters), "")
    if getattr(function, "jinja_pass_arg", None) is not None and first not in PASSED:
        args = args[1:]  # jinja passes its context first, and the shown signature (an async variant's) omits it
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None  # jinja reports the wrong call itself
    return predict(bound)


PASSED = ("eval_ctx", "context", "environment", "env")  # the names jinja's filters give what it passes them first


STR_METHODS: dict[str, Callable[..., int]] = {
    "replace": lambda s, old="", new="", count=-1, *_: _replace(s, old, new, count),
    "join": lambda s, items=(), *_: _join(items, s),
    "center": lambda s, width=0, *_: max(len(s), _int(width)),
    "ljust": lambda s, width=0, *_: max(len(s), _int(width)),
    "rjust": lambda s, width=0, *_: max(len(s), _int(width)),
    "zfill": lambda s, width=0, *_: max(len(s), _int(width)),
    "expandtabs": lambda s, tabsize=8, *_: len(s) + s.count("\t") * _int(tabsize, 8),
}


def call_size(function: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """The largest result of a call a template makes (a string's method, the lipsum global), where it can grow its
    input many times over; None for the others."""
    owner = getattr(function, "__self__", None)
    name = getattr(function, "__name__", "")
    if isinstance(owner, str) and name in STR_METHODS:
        try:
            return STR_METHODS[name](owner, *args, **kwargs)
        except TypeError:
            return None
    if name == "generate_lorem_ipsum":
        return _lipsum(*args, **kwargs)
    return None
