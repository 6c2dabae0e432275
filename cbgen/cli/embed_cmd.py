"""`cbgen embed`: an embedding for every row of a file, from an embedding model (the embedded all-MiniLM-L6-v2
by default)."""

from __future__ import annotations

from typing import Any

from cbgen.cli._options import ConfigFile, InputPath, embed_options
from cbgen.cli.run import job_command

EPILOG = (
    "[bold]Examples[/bold]\n\n"
    "  cbgen embed docs.jsonl -o vectors/   [dim]# rows with a text field, the embedded all-MiniLM-L6-v2[/dim]\n\n"
    "  cbgen embed answers.parquet --text-column answer --output-format parquet -o vectors/\n\n"
    "  cbgen embed rows.jsonl --template '{{ title }}: {{ body }}' --model ./my-embedder -o vectors/\n\n"
    "[bold]What a row embeds[/bold]: its text field (--text-column), else its prompt, else what --template makes "
    "of its columns; never a chat template. Texts longer than the model's max length are cut to it and marked "
    "truncated, as sentence-transformers does. A model folder with sentence-transformers modules (modules.json, "
    "1_Pooling/config.json) is pooled and normalised as they say; a plain encoder by the mean, a decoder "
    "embedding model by its last token (--pooling, --normalize change it).\n\n"
    "[bold]Output[/bold]: DIR/part-00000.jsonl ... with one row per input row (id, embedding, num_tokens, "
    "truncated, error, kept columns) and DIR/run.json; in Parquet the embedding is a fixed-size float32 list. "
    "Resuming, sharding, --redo failed, status and merge work as for cbgen run; a pipeline's `kind: dedup` stage "
    "removes near-duplicates by these embeddings.\n\n"
    "[bold]Exit codes[/bold]: 0 every row embedded · 1 some rows failed (they are in the output with their error) "
    "· 2 usage, configuration or input-file error · 3 unexpected internal error (CBGEN_DEBUG=1 shows the "
    "traceback) · 4 stopped after more than --max-errors failures · 75 stopped by SIGTERM or Ctrl-C (resumable)."
)


@embed_options
def embed(
    input_path: InputPath = None,
    config: ConfigFile = None,
    *,
    overrides: dict[tuple[str, str], tuple[Any, str]],
):
    """Embed text with an embedding model: one pooled vector per row."""
    job_command(input_path, config, overrides, "embed", "cbgen embed")
