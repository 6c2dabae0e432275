"""cbgen: offline batch generation on Hugging Face transformers' continuous batching.

    import cbgen
    results = cbgen.generate(["Why is the sky blue?"], max_new_tokens=64)
    with cbgen.Generator(model="Qwen/Qwen3-4B") as gen: ...
    summary = cbgen.run("prompts.jsonl", "out/")
    rows = cbgen.load("out/")
    report = cbgen.pipeline("pipeline.yaml", "out/")

See cbgen.api. Importing cbgen imports nothing heavy: torch and transformers load with the first model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["CbgenError", "Embedder", "Generator", "Result", "RowError", "embed", "generate", "load", "pipeline", "run"]

from cbgen.errors import CbgenError, RowError  # light: no torch, no transformers

if TYPE_CHECKING:
    from cbgen.api import Embedder, Generator, Result, embed, generate, load, pipeline, run


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cbgen import api

        return getattr(api, name)
    raise AttributeError(f"module 'cbgen' has no attribute {name!r}")
