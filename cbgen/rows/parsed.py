"""The `parsed` column: a structured answer as data, with an Arrow type derived from the job's JSON schema.

When a job or a row asks for JSON (a JSON schema, or any JSON object), each row carries `parsed`: the answer's JSON
value, or null when the output was cut by the token cap or failed. In JSONL it is the value itself. In Parquet its
type follows the job's schema, so that `datasets` and pandas read records, not text:

    object with properties    struct of those fields, in the schema's order (each nullable)
    array with items          list of the items' type
    string, integer, number,  string, int64, float64, bool (and an enum or const of one JSON type: that type; a
    boolean                   nullable type such as ["string", "null"]: the other one)

A part of the schema with no single Arrow type (anyOf of different types, an object without properties, $ref) is
JSON text in its place. Where no single schema holds for the whole job (rows with their own formats, or
--json-object), `parsed` is JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

Convert = Callable[[Any], Any]

_SCALARS: dict[str, tuple[pa.DataType, type | tuple[type, ...]]] = {
    "string": (pa.string(), str),
    "integer": (pa.int64(), int),
    "number": (pa.float64(), (int, float)),
    "boolean": (pa.bool_(), bool),
}


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


JSON_TEXT: tuple[pa.DataType, Convert] = (pa.string(), _json_text)


@dataclass(frozen=True)
class ParsedType:
    """The Arrow type of `parsed` for one JSON schema, and how a parsed value becomes a value of that type."""

    type: pa.DataType
    convert: Convert

    @classmethod
    def of(cls, schema: Mapping[str, Any] | None) -> ParsedType:
        """For the job's schema; None (no single schema): JSON text."""
        return cls(*(_node(schema) if schema is not None else JSON_TEXT))


def _scalar(kind: str) -> tuple[pa.DataType, Convert]:
    arrow, python = _SCALARS[kind]

    def convert(value: Any) -> Any:
        if value is None or isinstance(value, bool) and python is not bool:
            return None
        return value if isinstance(value, python) else None

    return arrow, convert


def _kinds(values: list[Any]) -> set[str]:
    kinds = set()
    for value in values:
        if isinstance(value, bool):
            kinds.add("boolean")
        elif isinstance(value, int):
            kinds.add("integer")
        elif isinstance(value, float):
            kinds.add("number")
        elif isinstance(value, str):
            kinds.add("string")
        else:
            kinds.add("other")
    return {"number"} if kinds == {"integer", "number"} else kinds


def _node(schema: Any) -> tuple[pa.DataType, Convert]:
    if not isinstance(schema, Mapping) or "$ref" in schema:
        return JSON_TEXT
    if "enum" in schema or "const" in schema:
        values = list(schema.get("enum", [])) + ([schema["const"]] if "const" in schema else [])
        found = _kinds([v for v in values if v is not None])
        return _scalar(found.pop()) if len(found) == 1 and "other" not in found else JSON_TEXT
    for key in ("anyOf", "oneOf"):
        if key in schema:
            variants = [v for v in schema[key] if not (isinstance(v, Mapping) and v.get("type") == "null")]
            return _node(variants[0]) if len(variants) == 1 else JSON_TEXT
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind in _SCALARS:
        return _scalar(kind)
    if kind == "array" and isinstance(schema.get("items"), Mapping):
        return _array(schema["items"])
    if kind in ("object", None) and isinstance(schema.get("properties"), Mapping) and schema["properties"]:
        return _object(schema["properties"])
    return JSON_TEXT


def _array(items: Mapping[str, Any]) -> tuple[pa.DataType, Convert]:
    item_type, item = _node(items)

    def convert(value: Any) -> Any:
        return [item(v) for v in value] if isinstance(value, list) else None

    return pa.list_(item_type), convert


def _object(properties: Mapping[str, Any]) -> tuple[pa.DataType, Convert]:
    fields = {name: _node(sub) for name, sub in properties.items()}

    def convert(value: Any) -> Any:
        if not isinstance(value, dict):
            return None
        return {name: to(value.get(name)) for name, (_, to) in fields.items()}

    return pa.struct([pa.field(name, arrow) for name, (arrow, _) in fields.items()]), convert
