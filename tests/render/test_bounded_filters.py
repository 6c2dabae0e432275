"""Templates bounded through their filters: the filters, methods, globals and operators that multiply what they are
given (a long replacement, a long separator, something added to every line, widths in a format, fills) are refused
before they build more than the row's budget, and whatever any of them builds is measured before the template goes
on. Composed at random near the budget, a row ends in its answer or its error and the render's peak memory stays
within a small multiple of the budget."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbgen.config import InputSection
from cbgen.errors import RowError
from cbgen.render.sandbox import Limits
from cbgen.render.templates import PromptTemplate
from tests.helpers import property_examples

BUDGET = 100_000
LIMITS = Limits(max_chars=BUDGET, seconds=5.0)
ROW = {"s": "x\t\n" * 30_000, "n": 50_000, "words": ["ab"] * 30_000}  # 90,000 characters, 30,000 lines


def render(text: str, row: dict | None = None) -> str:
    made = PromptTemplate.from_input(InputSection(template=text, raw_prompts=True))
    assert made is not None
    return made.render(ROW if row is None else row, LIMITS)


@pytest.mark.parametrize("text", [
    "{{ s | replace('x', 'y' * 1000) }}",  # 30,000 occurrences x 999 more characters
    "{{ s | replace('', 'yy') }}",
    "{{ words | join('-' * 10000) }}",
    "{{ s | indent(1000) }}",
    "{{ s | indent('#' * 1000) }}",
    "{{ s | wordwrap(1, wrapstring='-' * 100) }}",
    "{{ '%99999999s' | format('a') }}",
    "{{ '%*s' % (99999, 'a') ~ '%*s' % (99999, 'a') }}",
    "{{ '%99999999d' % 5 }}",
    "{{ '{:>99999999}'.format('a') }}",
    "{{ '{x:>99999999}'.format_map({'x': 'a'}) }}",
    "{{ s.replace('x', 'y' * 1000) }}",
    "{{ ('-' * 10000).join(words) }}",
    "{{ s.expandtabs(10000) }}",
    "{{ lipsum(5000, max=1000) }}",
    "{{ (words | batch(99999, 'z') | list) }}",
    "{{ words | slice(99999, 'z') | list }}",
    "{{ [words, words, words, words] | sum(start=[]) }}",
])
def test_a_multiplying_filter_is_refused_before_it_builds(text):
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(RowError, match=r"more than the 100,000 allowed; raise --max-render-chars"):
            render(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 2.0
    assert peak < 16 * BUDGET * 4, f"{peak:,} bytes at the peak"


def test_what_fits_renders_as_jinja_renders_it():
    row = {"s": "a\tb\nc", "n": 3, "words": ["x", "y"]}
    assert render("{{ s | replace('a', 'AA') }}|{{ words | join('--') }}|{{ s | indent(2, first=True) }}", row) == \
        "AA\tb\nc|x--y|  a\tb\n  c"
    assert render("{{ '%5s' | format('ab') }}|{{ '%-3d' % 7 }}|{{ '{:>4}'.format('z') }}|{{ s.expandtabs(2) }}",
                  row) == "   ab|7  |   z|a b\nc"
    assert render("{{ words | batch(3, '0') | list }}|{{ [words, words] | sum(start=[]) }}", row) == \
        "[['x', 'y', '0']]|['x', 'y', 'x', 'y']"


OPERATIONS = [  # template text with {e} for the value so far, {k} a string, {w} a width, {m} a count
    "({e}) | replace('x', {k})", "({e}) | replace('', {k})", "({e}) | indent({w})", "({e}) | indent({k})",
    "({e}) | wordwrap({w}, wrapstring={k})", "({e}) | center({w})", "('%' ~ {w} ~ 's') | format({e})",
    "({e}) ~ ({e})", "({e}) * {m}", "({e}) | list | join({k})", "({e}) | batch({w}, 'z') | list | join('')",
    "({e}).replace('\\t', {k})", "({k}).join(({e}) | list)", "({e}).ljust({w})", "({e}).expandtabs({w})",
    "('{{:>' ~ {w} ~ '}}').format({e})", "lipsum({m}, max={w}) ~ ({e})", "({e}) | truncate({w})", "({e}) | upper",
]


@st.composite
def templates(draw):
    expression = "s"
    for _ in range(draw(st.integers(1, 3))):
        operation = draw(st.sampled_from(OPERATIONS))
        expression = operation.format(
            e=expression, k=repr("y" * draw(st.sampled_from([0, 1, 7, 300, 20_000]))),
            w=draw(st.sampled_from([0, 1, 5, 99, 30_000, 99_999])), m=draw(st.sampled_from([0, 1, 2, 9, 300])))
    length = draw(st.sampled_from([0, 1, 50, 5_000, 33_000, 99_000]))
    return "{{ " + expression + " }}", {"s": ("x\ty\n" * (length // 4 + 1))[:length]}


@settings(max_examples=property_examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=templates())
def test_composed_filters_end_in_an_answer_or_an_error_within_memory(case):
    text, row = case
    tracemalloc.start()
    try:
        try:
            answer = render(text, row)
        except RowError as error:
            assert "--max-render-chars" in str(error) or "template failed" in str(error), str(error)
        else:
            assert len(answer) <= BUDGET
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * BUDGET * 4, f"{text}: {peak:,} bytes at the peak"
