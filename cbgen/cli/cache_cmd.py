"""`cbgen cache`: what the result cache holds, and keeping it small."""

from __future__ import annotations

import json
import time
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.filesize import decimal
from rich.table import Table

app = typer.Typer(help="Inspect, prune or clear the result cache (answers kept across runs).", no_args_is_help=True)

CacheDir = Annotated[
    Optional[str],  # noqa: UP045 (typer)
    typer.Option("--cache", help="The cache's directory (as for cbgen run). Default: $CBGEN_CACHE_DIR/results, else "
                 "~/.cache/cbgen/results.", metavar="DIR"),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead, for scripts.")]


def _store(directory: str | None):
    from cbgen.result_cache import default_cache_dir
    from cbgen.result_cache.store import ResultStore

    return ResultStore(default_cache_dir(directory))


def _size(text: str) -> int:
    """'4GB', '500MB', '1.5G', '2e9' -> bytes."""
    from cbgen.result_cache import parse_size

    return parse_size(text, "--max-size")


def _when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds)) if seconds else "-"


@app.command("info")
def info(cache: CacheDir = None, as_json: AsJson = False):
    """How many answers the cache holds, their size, and when they were last used.

    Example: cbgen cache info --json
    """
    found = _store(cache).info()
    if as_json:
        typer.echo(json.dumps(found.to_dict()))
        return
    table = Table(title="cbgen result cache", title_justify="left", show_header=False)
    for name, value in (("directory", found.directory), ("entries", f"{found.entries:,}"),
                        ("size", decimal(found.bytes)), ("least recently used", _when(found.oldest_use)),
                        ("most recently used", _when(found.newest_use))):
        table.add_row(name, value)
    Console().print(table)


@app.command("prune")
def prune(
    max_size: Annotated[str, typer.Option("--max-size", help="Keep at most this much (4GB, 500MB, ...): the least "
                                                             "recently used answers go first.", metavar="SIZE")],
    cache: CacheDir = None,
    as_json: AsJson = False,
):
    """Delete the least recently used answers until the cache is within a size.

    Example: cbgen cache prune --max-size 1GB
    """
    deleted, freed = _store(cache).prune(_size(max_size))
    _report(deleted, freed, as_json)


@app.command("clear")
def clear(cache: CacheDir = None, as_json: AsJson = False):
    """Delete every answer the cache holds.

    Example: cbgen cache clear --cache /scratch/cbgen-cache
    """
    deleted, freed = _store(cache).clear()
    _report(deleted, freed, as_json)


def _report(deleted: int, freed: int, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"deleted": deleted, "freed_bytes": freed}))
    else:
        typer.echo(f"deleted {deleted:,} answers ({decimal(freed)})")
