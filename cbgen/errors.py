"""The error types for user mistakes (a whole job's, one row's), and the exit codes cbgen documents."""

from __future__ import annotations

import os
from enum import IntEnum

DEBUG_VARIABLE = "CBGEN_DEBUG"


class ExitCode(IntEnum):
    """Process exit codes (also listed in `cbgen run --help` and docs/output.md)."""

    OK = 0  # every request succeeded
    SOME_FAILED = 1  # the run finished, some requests failed; they are in the output with their error
    USAGE = 2  # usage, configuration or input-file error: nothing was generated
    INTERNAL = 3  # an unexpected error inside cbgen or a library (set CBGEN_DEBUG=1 for the traceback)
    TOO_MANY_ERRORS = 4  # stopped once more requests than --max-errors had failed; resumable
    STOPPED = 75  # stopped by SIGTERM or Ctrl-C before the end; resumable (EX_TEMPFAIL: run it again)
    INTERRUPTED = 130  # a second Ctrl-C: stopped at once; still resumable


class CbgenError(Exception):
    """A mistake the user can fix: the message names the file, line or key and says how to fix it.

    The CLI prints it as one line and exits with code 2.
    """

    exit_code = ExitCode.USAGE


def debug_enabled() -> bool:
    """True when the user asked for tracebacks and library logs (CBGEN_DEBUG=1)."""
    return os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


class RowError(ValueError):
    """A problem with one input row: the row becomes an error record naming it, and the job goes on."""


def first_line(message: BaseException | str, limit: int = 300) -> str:
    """The first line of a message, at most `limit` characters: what a one-line error shows of a library's
    multi-line one. An exception without any text gives its type's name; an empty string gives ""."""
    text = str(message).strip()
    if not text:
        return type(message).__name__ if isinstance(message, BaseException) else ""
    return text.splitlines()[0][:limit]


def describe_type(value: object) -> str:
    """A JSON-ish name for the type of `value`, for row errors read by people who wrote JSON, not Python."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
