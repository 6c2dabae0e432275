"""Prompt templates over columns: rendered per row in Jinja2's sandbox with strict variables, for every input format;
syntax errors and columns no row can have exit 2 before any model loads; a row missing a variable is its own error
record; templates are part of the job's fingerprint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.cli import run_cli
from cbgen.config import InputSection
from cbgen.errors import CbgenError, RowError
from cbgen.render.sandbox import Limits, RenderStopped
from cbgen.render.templates import PromptTemplate, syntax_error_position
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

SEED = [
    {"topic": "rivers", "persona": {"name": "Ada", "age": 36}, "examples": ["Nile", "Rhine"]},
    {"topic": "stars", "persona": {"name": "Bo", "age": 9}, "examples": []},
]
TEMPLATE = ("Write a question about {{ topic }} for {{ persona.name }}, aged {{ persona.age }}."
            "{% for e in examples %} Like {{ e }}.{% endfor %}")


def template(**settings) -> PromptTemplate:
    made = PromptTemplate.from_input(InputSection(**settings))
    assert made is not None
    return made


def test_rows_render_into_turns_with_nested_values_and_loops():
    t = template(template=TEMPLATE, system="You write for {{ persona.name }}.",
                 messages=[{"role": "user", "content": "Example: {{ topic }}"}, {"role": "assistant", "content": "Q?"}])
    assert t.render(SEED[0]) == [
        {"role": "system", "content": "You write for Ada."},
        {"role": "user", "content": "Example: rivers"},
        {"role": "assistant", "content": "Q?"},
        {"role": "user", "content": "Write a question about rivers for Ada, aged 36. Like Nile. Like Rhine."},
    ]
    assert t.variables == {"topic", "persona", "examples"}  # the loop's own `e` is not a column
    raw = template(template="Q: {{ topic }}\nA:", raw_prompts=True)
    assert raw.render(SEED[1]) == "Q: stars\nA:"


def test_a_row_missing_a_variable_is_named():
    t = template(template=TEMPLATE)
    with pytest.raises(RowError, match=r"the template reads 'topic', which the row does not have \(its fields: "
                                       r"persona, examples\)"):
        t.render({"persona": {"name": "x", "age": 1}, "examples": []})
    with pytest.raises(RowError, match="has no attribute 'age'"):
        t.render({"topic": "t", "persona": {"name": "x"}, "examples": []})


@pytest.mark.parametrize("escape", ["{{ ''.__class__ }}", "{{ topic.__class__.__mro__ }}",
                                    "{{ examples.append(1) }}", "{{ cycler.__init__.__globals__ }}"])
def test_sandbox_escapes_are_refused(escape):
    with pytest.raises(RowError, match="refused by the sandbox|template failed"):
        template(template=escape).render(SEED[0])


LIMITS = Limits(max_chars=100_000, seconds=1.0)


@pytest.mark.parametrize(("text", "row", "message"), [
    ("{{ 'x' * 10**10 }}", {}, "a value of 10,000,000,000 characters"),
    ("{{ 'x' * (n * 100000) }}", {"n": 100000}, "a value of 10,000,000,000 characters"),
    ("{{ n ** (10**9) }}", {"n": 7}, "a number of"),
    ("{{ [1, 2] * 10**9 }}", {}, "a value of 2,000,000,000 characters"),
    ("{{ 'abc'.center(10**10) }}", {}, "(a call's argument) of 10,000,000,000"),
    ("{{ 'abc' | center(10**10) }}", {}, "(a call's argument) of 10,000,000,000"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     {}, "characters on this row, more than the 100,000 allowed"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", {},
     "a prompt of 100,001 characters"),
])
def test_a_runaway_template_is_that_rows_error_at_once(text, row, message):
    """Each would have taken gigabytes or hours: the sandbox measures what it is about to build (and what it writes)
    and stops the row, naming the limit and the setting that raises it."""
    start = time.monotonic()
    with pytest.raises(RowError) as error:
        template(template=text, raw_prompts=True).render(row, LIMITS)
    assert message in str(error.value) and "raise --max-render-chars (YAML input.max_render_chars)" in str(error.value)
    assert time.monotonic() - start < 1.0


def test_a_template_that_loops_without_writing_stops_at_its_time_limit():
    text = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done"
    start = time.monotonic()
    with pytest.raises(RowError, match=r"for more than 1 s; raise --render-timeout \(YAML input.render_timeout\)"):
        template(template=text, raw_prompts=True).render({}, LIMITS)
    assert 1.0 <= time.monotonic() - start < 2.0
    ordinary = "{% for e in examples %}{{ e }} {% endfor %}{{ topic * 3 }}"
    assert template(template=ordinary, raw_prompts=True).render({"examples": [1, 2], "topic": "ab"}, LIMITS) == \
        "1 2 ababab"


def test_a_stop_ends_a_render_in_progress():
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    with pytest.raises(RenderStopped):
        template(template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                 raw_prompts=True).render({}, Limits(max_chars=1_000_000, seconds=600), stop)
    assert time.monotonic() - start < 1.0


def test_the_size_budget_follows_the_models_context(tiny_model_dir):
    from cbgen.config import build_config
    from cbgen.model.source import context_tokens, source_of
    from cbgen.render.templates import FALLBACK_MAX_CHARS, render_limits

    def limits(job):
        return render_limits(job, context_tokens(source_of(job)))

    embedded = limits(build_config(None))
    assert embedded.max_chars == 16 * 8192 and embedded.seconds == 10.0  # SmolLM2: an 8,192-token context
    folder = limits(build_config(None, {("model", "model"): (str(tiny_model_dir), "--model")}))
    assert folder.max_chars == 16 * 256
    chosen = limits(build_config(None, {("input", "max_render_chars"): (5000, "--max-render-chars"),
                                        ("input", "render_timeout"): (2.5, "--render-timeout")}))
    assert (chosen.max_chars, chosen.seconds) == (5000, 2.5)
    assert render_limits(build_config(None), None).max_chars == FALLBACK_MAX_CHARS  # a context that cannot be read


def test_a_job_writes_runaway_rows_as_errors_and_the_others_as_answers(tiny_model_dir, tmp_path):
    rows = write_jsonl(tmp_path / "p.jsonl", [{"id": "small", "n": 1}, {"id": "huge", "n": 100000},
                                              {"id": "fine", "n": 2}])
    out = tmp_path / "out"
    code = run_cli(["run", str(rows), "-o", str(out), "--model", str(tiny_model_dir), "--template",
                    "Say {{ 'x' * (n * 10) }}", "--max-new-tokens", "2", "-q"])
    assert code == 1
    written = {row["id"]: row for row in read_shards(out)}
    assert written["small"]["error"] is None and written["fine"]["error"] is None
    # the tiny model's context is 256 tokens: 4,096 characters
    assert "a value of 1,000,000 characters on this row, more than the 4,096 allowed; raise --max-render-chars" \
        in written["huge"]["error"]


@pytest.mark.slow
def test_sigterm_during_a_render_stops_the_job_resumably(tiny_model_dir, tmp_path):
    """The first row's template loops for hours (its time limit raised to an hour): SIGTERM ends the render and the
    job exits 75 at once, having loaded no model; run again with a time limit, it resumes, the looping row written as
    that row's error."""
    rows = [{"id": "slow", "spin": 100000}, {"id": "quick", "spin": 1}]
    source = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "cbgen", "run", str(source), "-o", str(out), "--model", str(tiny_model_dir),
            "--max-new-tokens", "2", "--render-timeout", "3600", "--max-render-chars", "1000000", "--template",
            "{% for i in range(spin) %}{% for j in range(spin) %}{% endfor %}{% endfor %}Hi {{ spin }}"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:  # the plain progress says when it starts reading the rows
        if "checking" in line:
            break
    time.sleep(1.0)  # now inside the first row's render (it would take hours)
    assert process.poll() is None
    stopped = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 75, process.stdout.read()
    assert time.monotonic() - stopped < 5
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "stopped" and manifest["counts"]["succeeded"] == 0
    assert "model_load_s" not in manifest["timings"]  # it stopped while reading the rows, before loading a model
    resumed = [a if a != "3600" else "1" for a in args[3:]]
    assert run_cli([*resumed, "-q"]) == 1
    written = {row["id"]: row for row in read_shards(out)}
    assert written["quick"]["error"] is None and "raise --render-timeout" in written["slow"]["error"]


@pytest.mark.parametrize(("text", "position"), [
    ("Hello {{ topic ", (1, 16)),  # unexpected end: at the end of the template
    ("line one\nsay {{ topic | }} now", (2, 16)),  # the '}}' the filter name should stand before
    ("{{ a b }}", (1, 6)),
    ("{% for x in items %}no end", (1, 27)),
])
def test_syntax_errors_name_the_line_and_column(text, position):
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    with pytest.raises(TemplateSyntaxError) as error:
        ImmutableSandboxedEnvironment().parse(text)
    assert syntax_error_position(text, error.value.lineno, error.value.message) == position
    with pytest.raises(CbgenError, match=rf"--template: template syntax error at line {position[0]}, column "
                                         rf"{position[1]}: "):
        template(template=text)


def test_files_and_bad_settings(tmp_path):
    (tmp_path / "q.j2").write_text("About {{ topic }}.")
    assert template(template=f"@{tmp_path / 'q.j2'}").render(SEED[0])[-1]["content"] == "About rivers."
    with pytest.raises(CbgenError, match="--template: cannot read the template file"):
        template(template="@" + str(tmp_path / "missing.j2"))
    with pytest.raises(CbgenError, match=r"input.messages\[0\].role must be one of"):
        template(messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(CbgenError, match="--raw-prompts does not use"):
        template(template="x", system="y", raw_prompts=True)


def run(tiny_model_dir, source, out, *flags) -> int:
    return run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--max-new-tokens", "3",
                    "--dtype", "float32", "-q", *map(str, flags)])


def prompts_of(out) -> dict[str, int]:
    return {row["id"]: row["num_prompt_tokens"] for row in read_shards(out)}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "dataset"])
def test_every_input_format_renders_its_rows(tiny_model_dir, tmp_path, fmt):
    rows = [{"id": f"s{i}", **row} for i, row in enumerate(SEED)] + [{"id": "lacking", "topic": "sky",
                                                                       "persona": None, "examples": []}]
    if fmt == "jsonl":
        source = write_jsonl(tmp_path / "seed.jsonl", rows)
    elif fmt == "parquet":
        source = tmp_path / "seed.parquet"
        pq.write_table(pa.Table.from_pylist(rows), source)
    else:
        import datasets

        source = tmp_path / "seed-ds"
        datasets.Dataset.from_list(rows).save_to_disk(str(source))
    assert run(tiny_model_dir, source, tmp_path / "out", "--template", TEMPLATE, "--keep-columns", "topic") == 1
    out = {row["id"]: row for row in read_shards(tmp_path / "out")}
    assert out["s0"]["error"] is None and out["s0"]["topic"] == "rivers"
    assert out["s0"]["num_prompt_tokens"] > out["s1"]["num_prompt_tokens"]  # two examples more
    assert "the template reads what the row's value does not have" in out["lacking"]["error"]  # persona is null


def test_stdin_rows_render(tiny_model_dir, tmp_path):
    lines = "".join(json.dumps(row) + "\n" for row in SEED)
    done = subprocess.run([sys.executable, "-m", "cbgen", "run", "-", "-o", str(tmp_path / "out"), "--model",
                           str(tiny_model_dir), "--max-new-tokens", "2", "--template", TEMPLATE, "-q"],
                          input=lines, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(list(read_shards(tmp_path / "out"))) == 2


def test_the_templates_read_what_the_rows_are_rendered_from(tiny_model_dir, tmp_path):
    """The same chat as the rendered messages given as rows: the same prompt tokens."""
    t = template(template=TEMPLATE, system="Be brief.")
    seed = write_jsonl(tmp_path / "seed.jsonl", SEED)
    direct = write_jsonl(tmp_path / "direct.jsonl", [{"messages": t.render(row)} for row in SEED])
    assert run(tiny_model_dir, seed, tmp_path / "a", "--template", TEMPLATE, "--system", "Be brief.") == 0
    assert run(tiny_model_dir, direct, tmp_path / "b") == 0
    assert prompts_of(tmp_path / "a") == prompts_of(tmp_path / "b")


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr("cbgen.model.load.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def test_bad_templates_exit_2_before_the_model_loads(tmp_path, capsys, no_model):
    seed = write_jsonl(tmp_path / "seed.jsonl", SEED)
    assert run_cli(["run", str(seed), "-o", str(tmp_path / "o"), "--template", "Hi {{ topic "]) == 2
    assert "--template: template syntax error at line 1, column 13" in capsys.readouterr().err
    parquet = tmp_path / "seed.parquet"
    pq.write_table(pa.Table.from_pylist(SEED), parquet)
    assert run_cli(["run", str(parquet), "-o", str(tmp_path / "o2"), "--template", "{{ topik }} {{ topic }}"]) == 2
    err = capsys.readouterr().err
    assert "has no column 'topik', which the templates read; its columns are: topic, persona, examples" in err


def test_a_changed_template_is_another_job(tiny_model_dir, tmp_path, capsys):
    seed = write_jsonl(tmp_path / "seed.jsonl", SEED)
    assert run(tiny_model_dir, seed, tmp_path / "out", "--template", "About {{ topic }}.") == 0
    assert run(tiny_model_dir, seed, tmp_path / "out", "--template", "On {{ topic }}.") == 2
    assert "templates.user: 'About {{ topic }}.' -> 'On {{ topic }}.'" in capsys.readouterr().err
