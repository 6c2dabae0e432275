"""Checks of one row's fields, shared by every reader: each raises RowError naming the field and what it must be."""

from __future__ import annotations

from typing import Any

from cbgen.errors import RowError, describe_type

ROLES = ("assistant", "developer", "system", "tool", "user")
ROW_NUMBER = "@row"  # --id-column value that numbers the rows even when they carry an `id` field


def check_id(value: Any, column: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RowError(f"the id field {column!r} is missing, null or empty")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(f"the id field {column!r} must be a string or an integer, got {describe_type(value)}")
    return str(value)


def check_messages(field: str, messages: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"{field!r} message {i} must be an object with 'role' and 'content', "
                           f"got {describe_type(message)}")
        # Parquet structs carry every field on every row; a null there means the field is absent.
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role not in ROLES:
            got = "no role" if role is None else f"role {role!r}"
            raise RowError(f"{field!r} message {i} has {got}; expected one of {', '.join(ROLES)}")
        if role == "assistant" and isinstance(message.get("tool_calls"), list) and "content" not in message:
            message["content"] = ""  # a turn that only called tools
        if not isinstance(message.get("content"), (str, list)):
            got = "no content" if "content" not in message else f"content that is {describe_type(message['content'])}"
            raise RowError(f"{field!r} message {i} has {got}; expected a string (or a list of parts)")
        out.append(message)
    return out


def check_input_ids(field: str, ids: list[Any]) -> list[int]:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise RowError(f"{field!r} must be a list of non-negative integers; item {i} is {t!r}")
    return ids
