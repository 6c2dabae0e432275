"""Structured-output formats: what a job (flags, YAML) or a row (`response_format`, OpenAI's shape) asks generation
to follow, read into one canonical form, and the llguidance grammar each one becomes. Nothing here needs the model;
compiling a grammar for a tokenizer, and matching tokens against it, is cbgen.control.grammars' work.

Accepted shapes, as OpenAI and its peers write them:

    {"type": "text"}                                          no constraint
    {"type": "json_object"}                                   any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    {"type": "regex", "pattern": "..."}                       cbgen's own (and vLLM's guided_regex)
    {"type": "choice", "choices": ["yes", "no"]}              one of these strings exactly
    {"type": "grammar", "grammar": "..."}                     a Lark grammar (llguidance's dialect), or GBNF
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.errors import describe_type, first_line

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")  # and "tool_call", set by tool_choice
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar larger than this is a mistake, not a format


class FormatError(ValueError):
    """A response format that cannot be used; the message says which part and why."""


@dataclass(frozen=True)
class ResponseFormat:
    """One structured-output format. `spec` is canonical text: the schema as sorted JSON, the pattern, the choices
    as a JSON list, or the grammar; so equal formats have equal keys, and each compiles once."""

    kind: str
    spec: str
    name: str | None = None  # a json_schema's name, reported back as is

    @property
    def key(self) -> str:
        """The format as one string: what travels with a request to the engine (and to tensor-parallel ranks)."""
        return json.dumps([self.kind, self.spec])

    @classmethod
    def from_key(cls, key: str) -> ResponseFormat:
        kind, spec = json.loads(key)
        return cls(kind, spec)

    @property
    def schema(self) -> dict[str, Any] | None:
        return json.loads(self.spec) if self.kind == "json_schema" else None

    def describe(self) -> str:
        if self.kind == "json_schema":
            return f"JSON schema {self.name!r}" if self.name else "a JSON schema"
        return {"json_object": "a JSON object", "regex": "a regular expression", "choice": "one of the choices",
                "grammar": "a grammar", "tool_call": "a required tool call"}[self.kind]


def parse_response_format(value: Any, where: str = "response_format") -> ResponseFormat | None:
    """A row's or a job's `response_format` in any accepted shape; None for text (no constraint). Raises
    FormatError naming `where` and the part that is wrong."""
    if value is None:
        return None
    if isinstance(value, str):  # a bare schema or kind name, as some files carry it
        value = _loads(value, where)
    if not isinstance(value, dict):
        raise FormatError(f"{where!r} must be an object such as {{\"type\": \"json_object\"}}, got "
                          f"{describe_type(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", "{}")
    if kind == "json_schema":
        return _json_schema(value.get("json_schema"), f"{where}.json_schema")
    if kind == "regex":
        return regex_format(value.get("pattern"), f"{where}.pattern")
    if kind == "choice":
        return choice_format(value.get("choices"), f"{where}.choices")
    if kind == "grammar":
        return grammar_format(value.get("grammar"), f"{where}.grammar")
    raise FormatError(f"{where}.type must be one of text, {', '.join(KINDS)}; got {kind!r}")


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where!r} is not valid JSON: {e}") from None


def _json_schema(value: Any, where: str) -> ResponseFormat:
    if not isinstance(value, dict):
        raise FormatError(f"{where!r} must be an object with 'name' and 'schema', got {describe_type(value)}")
    name = value.get("name")
    if name is not None and not isinstance(name, str):
        raise FormatError(f"{where}.name must be a string, got {describe_type(name)}")
    return schema_format(value.get("schema"), f"{where}.schema", name=name)


def schema_format(schema: Any, where: str, name: str | None = None) -> ResponseFormat:
    """A JSON schema (an object, or its JSON text) as a format."""
    if isinstance(schema, str):
        schema = _loads(schema, where)
    if isinstance(schema, bool):  # true: anything; false: nothing can match
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise FormatError(f"{where!r} must be a JSON schema (an object), got {describe_type(schema)}")
    try:
        # key order kept: properties are generated in the order the schema lists them, as OpenAI does
        spec = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError, TypeError) as e:
        raise FormatError(f"{where!r} cannot be used as a schema: {e}") from None
    _bounded(spec, where)
    return ResponseFormat("json_schema", spec, name)


def regex_format(pattern: Any, where: str) -> ResponseFormat:
    if not isinstance(pattern, str) or not pattern:
        raise FormatError(f"{where!r} must be a non-empty regular expression, got {describe_type(pattern)}")
    _bounded(pattern, where)
    try:
        re.compile(pattern)  # the engine's dialect is close to Python's; it checks again when compiling
    except re.error as e:
        raise FormatError(f"{where!r} is not a valid regular expression: {e}") from None
    return ResponseFormat("regex", pattern)


def choice_format(choices: Any, where: str) -> ResponseFormat:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise FormatError(f"{where!r} must be a non-empty list of non-empty strings, got {describe_type(choices)}")
    spec = json.dumps(list(dict.fromkeys(choices)), ensure_ascii=False)
    _bounded(spec, where)
    return ResponseFormat("choice", spec)


def grammar_format(grammar: Any, where: str) -> ResponseFormat:
    if not isinstance(grammar, str) or not grammar.strip():
        raise FormatError(f"{where!r} must be a grammar text (Lark, or GBNF), got {describe_type(grammar)}")
    _bounded(grammar, where)
    return ResponseFormat("grammar", grammar)


def _bounded(spec: str, where: str) -> None:
    if len(spec) > MAX_SPEC_CHARS:
        raise FormatError(f"{where!r} is {len(spec):,} characters long; formats are limited to {MAX_SPEC_CHARS:,}")


def job_format(generation) -> ResponseFormat | None:
    """The job's format from its generation settings (the flags, or YAML `response_format`); at most one may be
    given. Raises FormatError naming the flag."""
    from pathlib import Path

    given = [name for name, set_ in (("--json-schema", generation.json_schema is not None),
                                     ("--json-object", generation.json_object), ("--regex", generation.regex),
                                     ("--choice", bool(generation.choice)), ("--grammar", generation.grammar),
                                     ("response_format", generation.response_format is not None)) if set_]
    if len(given) > 1:
        raise FormatError(f"{' and '.join(given)} each set the output format: give one")
    if generation.json_schema is not None:
        text = generation.json_schema
        path = Path(text).expanduser()
        if not text.lstrip().startswith(("{", "[")) and path.is_file():
            text = _read(path, "--json-schema")
        elif not text.lstrip().startswith(("{", "[")):
            raise FormatError(f"--json-schema: '{generation.json_schema}' is neither a file nor inline JSON")
        return schema_format(text, "--json-schema")
    if generation.json_object:
        return ResponseFormat("json_object", "{}")
    if generation.regex is not None:
        return regex_format(generation.regex, "--regex")
    if generation.choice:
        return choice_format(list(generation.choice), "--choice")
    if generation.grammar is not None:
        path = Path(generation.grammar).expanduser()
        if not path.is_file():
            raise FormatError(f"--grammar: file '{generation.grammar}' does not exist")
        return grammar_format(_read(path, "--grammar"), "--grammar")
    return parse_response_format(generation.response_format, "generation.response_format")


def _read(path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{flag}: cannot read '{path}': {e}") from None


def tool_call_format(tools: list[dict[str, Any]], name: str | None) -> ResponseFormat:
    """A required call of one of `tools` (or of the one named): compiled from the model's tool-call markup
    (cbgen.chat.tools.tool_call_grammar) once the model is known."""
    return ResponseFormat("tool_call", json.dumps({"tools": tools, "name": name}, ensure_ascii=False))


# Compact JSON: one fixed form of whitespace. With flexible whitespace a model that hesitates can wander through
# whitespace for many steps (measured with random logits: mask fills of seconds), and compact records are what a
# synthetic-data job wants anyway.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def check_format(fmt: ResponseFormat) -> None:
    """Compiles `fmt` without a tokenizer (before any model loads); raises FormatError if it cannot be."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar_text(fmt))
    if error:
        raise FormatError(f"{fmt.describe()} cannot be compiled: {first_line(error) or 'invalid'}")


def grammar_text(fmt: ResponseFormat, response_template: dict | None = None) -> str:
    """llguidance's grammar for `fmt` (a required tool call needs the model's `response_template`, which says
    how it writes calls). Raises FormatError when it cannot be built."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark  # `llguidance.gbnf_to_lark` is the module, not it

    try:
        if fmt.kind == "tool_call":
            from cbgen.chat.tools import tool_call_grammar

            if response_template is None:
                raise ValueError("the model has no response template to say how it writes tool calls")
            spec = json.loads(fmt.spec)
            return LLMatcher.grammar_from_lark(tool_call_grammar(response_template, spec["tools"], spec["name"]))
        if fmt.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if fmt.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(fmt.spec, defaults=JSON_OPTIONS)
        if fmt.kind == "regex":
            return LLMatcher.grammar_from_regex(fmt.spec)
        if fmt.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(fmt.spec)))
        text = gbnf_to_lark(fmt.spec) if "::=" in fmt.spec else fmt.spec
        return LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError, RecursionError) as e:
        raise FormatError(f"{fmt.describe()} cannot be compiled: {e}") from None
