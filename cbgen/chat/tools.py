"""OpenAI `tools` and `tool_choice`, read and checked without the model; and the grammar of a required call.

A request may offer functions (`tools`) and say whether the model may call one (`"auto"`), must (`"required"`, or a
named function), or must not (`"none"`: the tools are not shown to it). A required call is a constrained
generation: its grammar, built here from the model's response template, admits exactly one call, in the model's own
tool-call markup, whose `arguments` validate against the function's JSON schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cbgen.errors import RowError, describe_type

CHOICES = ("none", "auto", "required")


def check_tools(value: Any, where: str = "body.tools") -> list[dict[str, Any]]:
    """OpenAI's `[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`, checked."""
    if not isinstance(value, list) or not value:
        raise RowError(f"{where!r} must be a non-empty list of tools, got {describe_type(value)}")
    names = set()
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RowError(f"{where!r} tool {i} must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise RowError(f"{where!r} tool {i} needs a function name of letters, digits, _ . - (got {name!r})")
        if name in names:
            raise RowError(f"{where!r} names the function {name!r} twice")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise RowError(f"{where!r} tool {i} ({name}): 'parameters' must be a JSON schema object")
    return value


def check_tool_choice(value: Any, tools: list[dict[str, Any]] | None, where: str = "body.tool_choice") -> str:
    """"none", "auto", "required", or the name of the function the request forces."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str) and value in CHOICES:
        choice = value
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice = value["function"].get("name")
        if not isinstance(choice, str):
            raise RowError(f"{where!r}.function.name must be a string")
    else:
        raise RowError(f"{where!r} must be one of {', '.join(CHOICES)} or {{'type': 'function', 'function': "
                       f"{{'name': ...}}}}, got {value!r}"[:300])
    if choice != "none" and not tools:
        raise RowError(f"{where!r} is {choice!r} but the request offers no tools")
    if choice not in CHOICES and choice not in {t["function"]["name"] for t in tools or []}:
        raise RowError(f"{where!r} names the function {choice!r}, which is not among the request's tools")
    return choice


def call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON schema of one call `{"name", "arguments"}`: of the named function, or of any of the tools."""
    options = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        options.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": function["name"]},
                                       "arguments": function.get("parameters") or {"type": "object"}}})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _literal(field: dict[str, Any], key: str) -> str | None:
    """A tool-call anchor as the one literal text the model should write: the first of `open`/`close`, or a
    pattern that is plain text once optional whitespace at its ends (`\\s*`) is dropped; else None."""
    value = field.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, str):
        return value
    pattern = field.get(f"{key}_pattern")
    if not isinstance(pattern, str):
        return None
    core = pattern
    while core.startswith("\\s*"):
        core = core[3:]
    while core.endswith("\\s*"):
        core = core[:-3]
    text, i = [], 0
    while i < len(core):
        char = core[i]
        if char == "\\":
            if i + 1 >= len(core) or core[i + 1].isalnum():  # a class such as \\d: not one text
                return None
            text.append(core[i + 1])
            i += 2
        elif char in ".^$*+?{}[]|()":
            return None
        else:
            text.append(char)
            i += 1
    return "".join(text) or None


def tool_call_grammar(template: dict[str, Any], tools: list[dict[str, Any]], name: str | None) -> str:
    """A Lark grammar (llguidance's dialect) admitting one call in the template's tool-call markup. Raises
    ValueError naming why when the markup is not JSON between literal anchors (the shape cbgen can constrain)."""
    field = (template.get("fields") or {}).get("tool_calls")
    if not isinstance(field, dict):
        raise ValueError("the model's response template has no tool_calls field")
    opening, closing = _literal(field, "open"), _literal(field, "close")
    if field.get("content") != "json" or opening is None or closing is None:
        raise ValueError("the model's tool calls are not JSON between fixed markers, which is what cbgen can "
                         "constrain; use tool_choice 'auto'")
    # compact JSON: a model free to add whitespace can add it forever
    schema = json.dumps({**call_schema(tools, name), "x-guidance": {"whitespace_flexible": False}})
    return f"start: {json.dumps(opening)} call {json.dumps(closing)}\ncall: %json {schema}\n"


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: an assistant turn's tool-call `arguments` as an object, not the JSON
    text OpenAI carries."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for call in calls:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except ValueError:
                        pass
                fixed.append({**call, "function": function})
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out
