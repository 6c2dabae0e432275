"""Jinja2's sandbox, bounded: a row's rendering may use so much memory, so much time, and stops when the job stops.

Jinja2's `SandboxedEnvironment` keeps Python's internals out of reach (`__class__`, unsafe attributes, `format`, a
`range` over more than 100,000 items), but a template can still take a whole job down with a little arithmetic:
`{{ 'x' * 10**10 }}` asked for ten gigabytes (the kernel killed the job), two nested `range(100000)` loops ran for
hours and did not stop on SIGTERM, and `{{ 'x' * (n * 100000) }}` built a ten-billion-character prompt from one
row's value. So every rendering of a template made here runs under a `Budget`:

- **size**: what it writes is streamed (`Template.generate`) and counted; the operations that can build a large
  value in one step are checked before they run: `*`, `**`, `+` and `%` (the sandbox's intercepted operators), `~`
  (concatenation, rewritten into a checked call), any call of a filter, method or function with an integer argument
  above the budget (`center(10**10)`), and the filters and methods that multiply what they are given (`replace`,
  `join`, `indent`, `wordwrap`, `format`, `batch`, `lipsum`...: cbgen.render.bounds works out their result's size
  from their arguments); and what every filter, call and operator built is measured before the template goes on;
- **time**: every loop checks the clock (each `{% for %}` iterates through a checked generator), as do the
  operations above and each piece of output;
- **stop**: the same checks look at the job's stop event (SIGTERM, Ctrl-C), so a render in progress ends at once.

Exceeding the size or time budget raises `RenderLimit` (the row becomes an error record naming the limit and the
setting that raises it); the stop event raises `RenderStopped`, which the job treats as a stop, not as the row's
fault. Outside a budget (parsing, checking the variables a template reads) nothing is counted.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from cbgen.render.bounds import call_size, filter_size, format_size, percent_size, size_of

CHECK_EVERY = 256  # loop iterations between looks at the clock and the stop event


class RenderLimit(Exception):
    """A row's rendering went past its size or time budget."""


class RenderStopped(BaseException):
    """The job was asked to stop while a row rendered: a stop, like KeyboardInterrupt, not the row's error (so no
    handler meant for a row's failure takes it for one)."""


@dataclass(frozen=True)
class Limits:
    """A row's budget: `max_chars` characters in any value or in the whole output, `seconds` of rendering."""

    max_chars: int
    seconds: float
    chars_setting: str = "--max-render-chars (YAML input.max_render_chars)"
    seconds_setting: str = "--render-timeout (YAML input.render_timeout)"


class Budget:
    """One rendering's budget, checked by the environment's hooks while it is the thread's current budget."""

    def __init__(self, limits: Limits, stop: threading.Event | None = None) -> None:
        self.limits = limits
        self.stop = stop
        self.deadline = time.monotonic() + limits.seconds
        self.written = 0
        self._ticks = 0

    def check(self) -> None:
        """Raises when the job stops or the time is up."""
        if self.stop is not None and self.stop.is_set():
            raise RenderStopped("the job is stopping")
        if time.monotonic() > self.deadline:
            raise RenderLimit(f"the template rendered this row for more than {self.limits.seconds:g} s; raise "
                              f"{self.limits.seconds_setting} if that is expected")

    def tick(self) -> None:
        """A loop iteration: the clock and the stop event are looked at every CHECK_EVERY of them."""
        self._ticks += 1
        if self._ticks % CHECK_EVERY == 0:
            self.check()

    def size(self, chars: int, what: str) -> None:
        """Raises when a value of `chars` characters (or items) would exceed the budget."""
        if chars > self.limits.max_chars:
            raise RenderLimit(f"the template would make {what} of {chars:,} characters on this row, more than the "
                              f"{self.limits.max_chars:,} allowed; raise {self.limits.chars_setting} if that is "
                              "expected")

    def wrote(self, piece: str) -> None:
        self.written += len(piece)
        self.size(self.written, "a prompt")
        self.tick()


_current = threading.local()


def current() -> Budget | None:
    return getattr(_current, "budget", None)


def _length(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _check_product(budget: Budget, left: Any, right: Any) -> None:
    for sequence, count in ((left, right), (right, left)):
        length = _length(sequence)
        if length is not None and isinstance(count, int) and not isinstance(count, bool):
            budget.size(length * max(count, 0), "a value")


def _check_power(budget: Budget, base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        digits = int(exponent * abs(base).bit_length() * 0.302) + 1  # decimal digits of the result, about
        budget.size(digits, "a number")


def _check_arguments(budget: Budget, args: Iterable[Any]) -> None:
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool) and value > budget.limits.max_chars:
            budget.size(value, "a value (a call's argument)")


class _Unfolded(Exception):
    """Raised by a filter called outside a render: jinja, which folds a filter of constants while it compiles the
    template (`{{ '%99999999s' | format('a') }}`), then leaves it to run when the row renders, under its budget."""


class _Guarding(NodeTransformer):
    """Rewrites a parsed template: each loop iterates through the environment's checked generator, and each `~`
    concatenation goes through a checked join."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("cbgen_loop"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("cbgen_concat"), list(node.nodes), [], None, None,
                          lineno=node.lineno)


def _built(budget: Budget | None, value: Any, what: str) -> Any:
    """`value`, once measured against the budget (what an operation built: no step may leave more than it)."""
    if budget is not None and (size := size_of(value)) is not None:
        budget.size(size, what)
    return value


def _guarded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment markers
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        if budget is None:  # jinja folding a filter of constants while it compiles: left for the render, budgeted
            raise _Unfolded(name)
        budget.check()
        _check_arguments(budget, (*args[1:], *kwargs.values()))
        what = f"a value (the {name} filter's)"
        predicted = filter_size(name, function, args, kwargs)
        if predicted is not None:
            budget.size(predicted, what)
        return _built(budget, function(*args, **kwargs), what)

    return guarded


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the checks above (active while a `Budget` is the thread's current one)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _guarded_filter(name, f) for name, f in self.filters.items()}

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Guarding().visit(super()._parse(source, name, filename))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        if budget is not None:
            budget.check()
            if operator == "*":
                _check_product(budget, left, right)
            elif operator == "**":
                _check_power(budget, left, right)
            elif operator == "+":
                if _length(left) is not None and _length(right) is not None:
                    budget.size(len(left) + len(right), "a value")
            elif operator == "%" and isinstance(left, str):
                budget.size(percent_size(left, right), "a value (a % format's)")
        return _built(budget, super().call_binop(context, operator, left, right), "a value")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's names
        budget = current()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.check()
        _check_arguments(budget, (*args, *kwargs.values()))
        predicted = call_size(__obj, args, kwargs)
        if predicted is not None:
            budget.size(predicted, "a value (a call's)")
        return _built(budget, super().call(__context, __obj, *args, **kwargs), "a value (a call's)")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format and format_map, sandboxed by jinja, with the widths of their fields counted first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text: str = value.__self__
        mapping = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            budget = current()
            if budget is not None:
                values = (args[0] if mapping and args and isinstance(args[0], dict) else kwargs)
                budget.size(format_size(text, () if mapping else args, values), "a value (a format's)")
            return _built(budget, wrapped(*args, **kwargs), "a value (a format's)")

        return bounded

    def cbgen_loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        budget = current()
        if budget is None:
            yield from iterable
            return
        for item in iterable:
            budget.tick()
            yield item

    def cbgen_concat(self, *parts: Any) -> str:
        texts = [str(part) for part in parts]
        budget = current()
        if budget is not None:
            budget.size(sum(map(len, texts)), "a value")
        return "".join(texts)


def render(template: Any, values: dict[str, Any], budget: Budget) -> str:
    """`template` rendered with `values` under `budget`, streamed and counted piece by piece."""
    previous = current()
    _current.budget = budget
    try:
        budget.check()
        pieces = []
        for piece in template.generate(values):
            budget.wrote(piece)
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _current.budget = previous
