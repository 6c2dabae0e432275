"""The model: where it comes from (source.py, no torch), the converted-GGUF cache (cache.py), loading it (load.py)
and loading it sharded for tensor parallelism (sharded.py)."""

from __future__ import annotations

from typing import Any

from cbgen.cache_root import CACHE_ENV, default_cache_dir  # noqa: F401 (read here by the model's rooms)


def dtype_name(dtype: Any) -> str:
    """A torch dtype as cbgen's settings and records spell it: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
