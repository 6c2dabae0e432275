"""The Parquet schema of output rows (their fields are their kind's, cbgen.kinds)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from cbgen.rows.columns import OutputColumns
from cbgen.rows.parsed import ParsedType

_BASE_TYPES: dict[str, pa.DataType] = {
    "id": pa.string(),
    "sample_index": pa.int32(),
    "text": pa.string(),
    "token_ids": pa.list_(pa.int32()),
    "num_prompt_tokens": pa.int32(),
    "num_generated_tokens": pa.int32(),
    "finish_reason": pa.string(),
    "error": pa.string(),
}


_SCORE_TYPES: dict[str, pa.DataType] = {
    "id": pa.string(),
    "num_prompt_tokens": pa.int32(),
    "num_scored_tokens": pa.int32(),
    "logprob": pa.float64(),
    "mean_logprob": pa.float64(),
    "perplexity": pa.float64(),
    "choices": pa.list_(pa.string()),
    "choice_logprobs": pa.list_(pa.float64()),
    "choice_mean_logprobs": pa.list_(pa.float64()),
    "choice_probs": pa.list_(pa.float64()),
    "best_choice": pa.string(),
    "error": pa.string(),
}


TOP_LOGPROBS_TYPE = pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("token", pa.string()),
                                                   ("logprob", pa.float32())])))


TOOL_CALLS_TYPE = pa.list_(pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())]))
_ENCODED_TYPES: dict[str, pa.DataType] = {
    "num_tokens": pa.int32(),
    "truncated": pa.bool_(),
    "label": pa.string(),
}


MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_CHAT_TYPES: dict[str, pa.DataType] = {
    "messages": MESSAGES_TYPE,
    "num_turns": pa.int32(),
    "turns": pa.list_(pa.struct([("role", pa.string()), ("finish_reason", pa.string()),
                                 ("num_prompt_tokens", pa.int32()), ("num_cached_tokens", pa.int32()),
                                 ("num_generated_tokens", pa.int32())])),
    "num_cached_tokens": pa.int32(),
}


# every column a kind's rows may have (cbgen.kinds), but `parsed`, whose type the job's schema decides
_TYPES: dict[str, pa.DataType] = _BASE_TYPES | _SCORE_TYPES | _ENCODED_TYPES | _CHAT_TYPES | {
    "logprobs": pa.list_(pa.float32()), "top_logprobs": TOP_LOGPROBS_TYPE, "reasoning": pa.string(),
    "tool_calls": TOOL_CALLS_TYPE}


def arrow_schema(columns: OutputColumns, kept_schema: pa.Schema | None) -> pa.Schema | None:
    """The Parquet schema of rows with `columns`, or None while a kept column's type is still unknown.

    Kept columns take their types from `kept_schema` (the input's own schema, for Parquet input). When a kept
    column is missing from it (JSONL input), the writer infers one with `infer_kept_schema` and asks again.
    """
    own = [name for name in columns.names if name not in columns.kept]
    fields = [pa.field(name, _type_of(name, columns)) for name in own]
    return _with_kept(fields, columns, kept_schema)


def _type_of(name: str, columns: OutputColumns) -> pa.DataType:
    if name == "parsed":
        return parsed_type(columns).type
    if name == "embedding":  # a fixed-size list: every row's vector has the model's size
        return pa.list_(pa.float32(), columns.dimensions) if columns.dimensions else pa.list_(pa.float32())
    if name in columns.labels:
        return pa.float64()
    return _TYPES[name]


def _with_kept(fields: list[pa.Field], columns: OutputColumns, kept_schema: pa.Schema | None) -> pa.Schema | None:
    for name in columns.kept:
        if kept_schema is None or kept_schema.get_field_index(name) < 0:
            return None
        fields.append(pa.field(name, kept_schema.field(name).type))
    return pa.schema(fields)


def parsed_type(columns: OutputColumns) -> ParsedType:
    """The Arrow type of the `parsed` column (and its conversion), from the job's one schema or as JSON text."""
    return ParsedType.of(json.loads(columns.parsed_schema) if columns.parsed_schema else None)


def for_arrow(rows: Iterable[dict[str, Any]], columns: OutputColumns | None, jsonl: bool
              ) -> Iterator[dict[str, Any]]:
    """Stored rows made ready for cbgen's Arrow schema: JSONL shards hold `parsed` as the JSON value itself, which
    becomes its column's Arrow value (Parquet shards hold that already)."""
    if columns is None or not columns.parsed or not jsonl:
        yield from rows
        return
    convert = parsed_type(columns).convert
    for row in rows:
        yield row | {"parsed": convert(row.get("parsed"))}


def infer_kept_schema(rows: Iterable[Mapping[str, Any]], kept_names: Sequence[str]) -> pa.Schema:
    """Types for kept columns from sample rows, so JSONL input can still be written as Parquet.

    Each column takes the type pyarrow infers from its non-null values in `rows` (int and float mixed give float,
    dicts with different keys merge into one struct). A column with no non-null value, values pyarrow cannot
    unify, or a type that still contains null (e.g. lists that are all empty) falls back to string: a string
    column never locks a later shard out, as the writer JSON-encodes non-string values into it.
    """
    rows = list(rows)
    fields = []
    for name in kept_names:
        values = [row.get(name) for row in rows if row.get(name) is not None]
        type_: pa.DataType = pa.string()
        if values:
            try:
                inferred = pa.array(values).type
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                inferred = pa.string()
            if not _contains_null(inferred):
                type_ = inferred
        fields.append(pa.field(name, type_))
    return pa.schema(fields)


def _contains_null(type_: pa.DataType) -> bool:
    if pa.types.is_null(type_):
        return True
    return any(_contains_null(type_.field(i).type) for i in range(type_.num_fields))
