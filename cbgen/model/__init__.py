"""The model: where it comes from (source.py, no torch), the converted-GGUF cache (cache.py), loading it (load.py)
and loading it sharded for tensor parallelism (sharded.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cbgen.config import ModelSection

CACHE_ENV = "CBGEN_CACHE_DIR"
KERNEL_CACHE_ENV = "CBGEN_KERNEL_CACHE_DIR"


def dtype_name(dtype: Any) -> str:
    """A torch dtype as cbgen's settings and records spell it: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def default_cache_dir(settings: ModelSection | None = None) -> Path:
    """--model-cache-dir, else $CBGEN_CACHE_DIR, else $XDG_CACHE_HOME/cbgen, else ~/.cache/cbgen."""
    if settings is not None and settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "cbgen"


def kernel_cache_dir() -> Path:
    """Where compiled kernels and the linear layers' tile probes are kept: $CBGEN_KERNEL_CACHE_DIR, else `kernels` in
    the cache folder. Its own setting, so that a job with another model or result cache (--model-cache-dir, a test's
    folder) loads the kernels this machine already built instead of building them again."""
    if os.environ.get(KERNEL_CACHE_ENV):
        return Path(os.environ[KERNEL_CACHE_ENV]).expanduser()
    return default_cache_dir() / "kernels"
