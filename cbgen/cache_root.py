"""Where cbgen keeps what it caches on disk: the cache folder (converted GGUF models, the embedded embedder, file
digests, the result cache's default home) and the compiled kernels' folder, each its own setting. Read by every room
that caches something, so it stands below them all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CACHE_ENV = "CBGEN_CACHE_DIR"
KERNEL_CACHE_ENV = "CBGEN_KERNEL_CACHE_DIR"


def default_cache_dir(settings: Any = None) -> Path:
    """--model-cache-dir (model settings' `cache_dir`, where given), else $CBGEN_CACHE_DIR, else
    $XDG_CACHE_HOME/cbgen, else ~/.cache/cbgen."""
    if settings is not None and getattr(settings, "cache_dir", None):
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
