"""Prompt templates over a row's columns: `--template`, `--system` and YAML `input.messages`, rendered per row.

A seed dataset has columns (`topic`, `persona`, `document`, ...); a template turns each row into the prompt:

    --template 'Write a question about {{ topic }} for {{ persona.name }}.'      the user turn
    --system @system.j2                                                          a system turn, itself a template
    input.messages: [{role: user, content: ...}, {role: assistant, content: ...}]  few-shot turns, before the user's

Templates are Jinja2, in its sandboxed environment (no attribute of Python's internals is reachable: `{{
''.__class__ }}` is refused) with strict undefined variables (a row without a variable the template reads becomes
that row's error record, naming the variable). Nested values are reached with dots (`{{ doc.title }}`) and lists
looped over (`{% for q in examples %}`); blocks trim their newlines as chat templates do. With `--raw-prompts` the
user template's text is the prompt itself, without the chat template. `TEXT` or `@FILE` (read as UTF-8) for each.

A template is checked when the job starts, before any model loads: a syntax error names the line and column, and for
inputs with a schema (Parquet, datasets) a variable that no row can have names the columns there are. Each row renders
under a budget of size and time (cbgen.render.sandbox, `render_limits`): a row whose template would build a value or a
prompt past `--max-render-chars`, or run past `--render-timeout`, becomes that row's error record; a job that is
stopping (SIGTERM, Ctrl-C) stops a render in progress at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.errors import CbgenError, RowError, first_line

if TYPE_CHECKING:
    import threading

    from jinja2 import Template

    from cbgen.config import InputSection, JobConfig
    from cbgen.render.sandbox import Limits

ROLES = ("system", "user", "assistant", "developer")
CHARS_PER_TOKEN = 16  # the default size budget: this many characters per token of the model's context
FALLBACK_MAX_CHARS = 1_000_000  # where the context cannot be read
DEFAULT_TIMEOUT = 10.0


def render_limits(job: JobConfig, context: int | None) -> Limits:
    """A row's rendering budget for `job`: --max-render-chars, else derived from the model's `context` in tokens
    (cbgen.model.source.context_tokens, read without loading the model; None where it cannot be told), and
    --render-timeout."""
    from cbgen.render.sandbox import Limits

    chars = job.input.max_render_chars
    if chars is None:
        chars = CHARS_PER_TOKEN * context if context else FALLBACK_MAX_CHARS
    return Limits(max_chars=chars, seconds=job.input.render_timeout)


@dataclass(frozen=True)
class PromptTemplate:
    """A job's prompt templates, as text (files already read): what the fingerprint records."""

    user: str | None = None  # the user turn's template (the prompt itself with --raw-prompts)
    system: str | None = None
    messages: tuple[tuple[str, str], ...] = ()  # (role, content template): turns between the system's and the user's
    raw: bool = False  # the user template renders the prompt text, not a chat turn
    names: tuple[str, str] = ("--template", "--system")  # the user's and the system's, as messages name them

    @classmethod
    def of(cls, user: str | None, system: str | None, names: tuple[str, str]) -> PromptTemplate | None:
        """Templates given by other settings than the input's (a chat stage's simulated user), TEXT or @FILE
        each, `names` the settings' names; compiled now. None when neither is given."""
        if user is None and system is None:
            return None
        template = cls(_text(user, names[0]), _text(system, names[1]), names=names)
        template.compiled  # noqa: B018 - they parse now, before any model loads
        return template

    @classmethod
    def from_input(cls, settings: InputSection) -> PromptTemplate | None:
        """The job's templates, or None when it has none. Raises CbgenError for a file that cannot be read, a
        turn of input.messages that is not {role, content}, a template that does not parse, or a combination
        that cannot work."""
        if settings.template is None and settings.system is None and not settings.messages:
            return None
        turns = tuple(_turn(i, turn) for i, turn in enumerate(settings.messages or []))
        template = cls(_text(settings.template, "--template"), _text(settings.system, "--system"), turns,
                       settings.raw_prompts)
        if template.raw and (template.system is not None or template.messages):
            raise CbgenError("--system and input.messages are turns of the chat template, which --raw-prompts does "
                             "not use: drop --raw-prompts, or put the whole prompt in --template")
        if template.raw and template.user is None:
            raise CbgenError("--raw-prompts with templates needs --template: the prompt's text")
        template.compiled  # noqa: B018 - every template parses now, before any model loads
        return template

    def to_dict(self) -> dict[str, Any]:
        return {"user": self.user, "system": self.system, "messages": [list(turn) for turn in self.messages],
                "raw": self.raw}

    def turns(self) -> list[tuple[str, str, str]]:
        """(role, template text, where it was given) of every turn, in order: the system's, input.messages, the
        user's last ("prompt" with --raw-prompts)."""
        turns = [("system", self.system, self.names[1])] if self.system is not None else []
        turns += [(role, text, f"input.messages[{i}].content") for i, (role, text) in enumerate(self.messages)]
        if self.user is not None:
            turns.append(("prompt" if self.raw else "user", self.user, self.names[0]))
        return turns

    @cached_property
    def compiled(self) -> list[tuple[str, Template]]:
        """(role, compiled template) of every turn."""
        return [(role, _compile(text, where)) for role, text, where in self.turns()]

    @cached_property
    def variables(self) -> frozenset[str]:
        """The row fields the templates read (top-level names; loop variables and Jinja's globals left out)."""
        from jinja2 import meta

        env = _environment()
        names: set[str] = set()
        for _, text, _ in self.turns():
            names |= meta.find_undeclared_variables(env.parse(text))
        return frozenset(names - set(env.globals))

    @cached_property
    def attributes(self) -> dict[str, frozenset[str]]:
        """For each row field the templates read, the names they read inside it (`{{ doc.title }}` or
        `{{ doc["title"] }}` read `title` of `doc`), for checking them against a known schema."""
        from jinja2 import nodes

        env = _environment()
        found: dict[str, set[str]] = {name: set() for name in self.variables}
        for _, text, _ in self.turns():
            for node in env.parse(text).find_all((nodes.Getattr, nodes.Getitem)):
                inner = node.node
                attr = node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)
                if isinstance(inner, nodes.Name) and inner.name in found and isinstance(attr, str):
                    found[inner.name].add(attr)
        return {name: frozenset(attrs) for name, attrs in found.items()}

    def render(self, row: Mapping[str, Any], limits: Limits | None = None, stop: threading.Event | None = None
               ) -> str | list[dict[str, str]]:
        """The prompt text (raw) or the chat turns for one row, within `limits` (default: the fallback budget).
        Raises RowError naming what the row lacks or the limit it hit; cbgen.render.sandbox.RenderStopped once `stop` is
        set."""
        from jinja2.exceptions import SecurityError, UndefinedError

        from cbgen.render.sandbox import Budget, Limits, RenderLimit, render

        budget = Budget(limits or Limits(FALLBACK_MAX_CHARS, DEFAULT_TIMEOUT), stop)
        rendered = []
        for role, template in self.compiled:
            try:
                rendered.append((role, render(template, dict(row), budget)))
            except RenderLimit as e:
                raise RowError(str(e)) from None
            except UndefinedError as e:
                raise RowError(_undefined(e, row)) from None
            except SecurityError as e:
                raise RowError(f"the template was refused by the sandbox: {first_line(e)}") from None
            except Exception as e:  # noqa: BLE001 - a filter or test may raise anything on one row's values
                raise RowError(f"the template failed on this row: {type(e).__name__}: {first_line(e, 200)}") from None
        if self.raw:
            return rendered[-1][1]
        return [{"role": role, "content": content} for role, content in rendered]


def _text(value: str | None, flag: str) -> str | None:
    """TEXT, or the contents of FILE for @FILE."""
    if value is None or not value.startswith("@"):
        return value
    path = Path(value[1:]).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise CbgenError(f"{flag}: cannot read the template file '{path}': {reason}") from None


def _turn(index: int, turn: Any) -> tuple[str, str]:
    where = f"input.messages[{index}]"
    if not isinstance(turn, Mapping) or set(turn) - {"role", "content"} or "content" not in turn:
        raise CbgenError(f"{where} must be a mapping of role and content, such as {{role: user, content: ...}}")
    role, content = turn.get("role", "user"), turn["content"]
    if role not in ROLES:
        raise CbgenError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    if not isinstance(content, str):
        raise CbgenError(f"{where}.content must be a template (text), got {type(content).__name__}")
    return role, _text(content, f"{where}.content") or ""


def _environment() -> Any:
    from jinja2 import StrictUndefined

    from cbgen.render.sandbox import BoundedEnvironment

    return BoundedEnvironment(undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=False, autoescape=False)


def _compile(text: str, where: str) -> Template:
    from jinja2 import TemplateSyntaxError

    try:
        return _environment().from_string(text)
    except TemplateSyntaxError as e:
        line, column = syntax_error_position(text, e.lineno, e.message or "")
        raise CbgenError(f"{where}: template syntax error at line {line}, column {column}: {e.message}; fix the "
                         "template (Jinja2 syntax)") from None


_TOKENS = {"end of print statement": "}}", "end of statement block": "%}"}


def syntax_error_position(text: str, line: int, message: str) -> tuple[int, int]:
    """Where a Jinja2 syntax error is, as (line, column) from 1. Jinja gives the line only: the column is where the
    token it complains of stands on that line (the end of the template for an unexpected end), else the line's
    first tag."""
    lines = text.splitlines() or [""]
    if "end of template" in message.lower():
        return len(lines), len(lines[-1]) + 1
    current = lines[min(max(line, 1), len(lines)) - 1]
    got = re.search(r"got '([^']*)'", message)
    if got:
        token = _TOKENS.get(got.group(1), got.group(1))
        tag = max(current.find("{{"), current.find("{%"), 0)
        found = current.find(token, tag + 2 if token in _TOKENS.values() else tag)
        if found >= 0:
            return line, found + 1
    tags = [i for i in (current.find("{{"), current.find("{%")) if i >= 0]
    return line, (min(tags) + 1) if tags else 1


def _undefined(error: Exception, row: Mapping[str, Any]) -> str:
    message = first_line(error, 200)
    name = re.fullmatch(r"'([^']+)' is undefined", message)
    if name:
        fields = ", ".join(list(row)[:20]) or "none"
        return f"the template reads {name.group(1)!r}, which the row does not have (its fields: {fields})"
    return f"the template reads what the row's value does not have: {message}"
