"""Prompt templates over columns: rendered per row in Jinja2's sandbox with strict variables, for every input format;
syntax errors and columns no row can have exit 2 before any model loads; a row missing a variable is its own error
record; templates are part of the job's fingerprint."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.cli import run_cli
from cbgen.config import InputSection
from cbgen.errors import CbgenError, RowError
from cbgen.outputs import read_shards
from cbgen.templates import PromptTemplate, syntax_error_position
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
