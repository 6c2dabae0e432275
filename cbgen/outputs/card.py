"""The dataset card: a `README.md` in every output directory (and every merged one) that makes it a dataset.

Its YAML metadata names the data files in order, so `datasets.load_dataset(DIR)` loads the shards as one `train`
split (in input order, once the run is complete: cbgen.rows.order), and records how the rows were made: the
model, the generation settings, the templates, the counts, the cbgen version and the command line. The hub reads
the same card when the folder is uploaded (`hf upload NAME DIR --repo-type dataset`); huggingface_hub's DatasetCard
parses it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from cbgen import __version__
from cbgen.files import write_text_atomic
from cbgen.kinds import kind_of
from cbgen.rows.columns import OutputColumns

CARD_FILE = "README.md"

_MEANINGS = {
    "id": "the input row's id",
    "sample_index": "which of the request's sequences (0 to n-1)",
    "text": "the generated text (for replies split by a response template: the answer alone)",
    "token_ids": "the generated token ids",
    "num_prompt_tokens": "prompt tokens the engine took in",
    "num_generated_tokens": "tokens generated",
    "finish_reason": "stop, length (the token cap) or error",
    "error": "why the request failed, else null",
    "logprobs": "the model's own log-probability of each generated token",
    "top_logprobs": "per generated token, the most likely tokens with their logprobs",
    "reasoning": "a reasoning model's thinking, apart from the answer",
    "tool_calls": "the tool calls the reply made",
    "parsed": "the answer's JSON value (null when cut or failed)",
    "num_scored_tokens": "tokens scored (the completion's, the text's after its first, or all the choices')",
    "logprob": "the summed logprob of the completion or text",
    "mean_logprob": "logprob per scored token",
    "perplexity": "exp(-mean_logprob)",
    "choices": "the choices scored as continuations of the prompt",
    "choice_logprobs": "each choice's summed logprob",
    "choice_mean_logprobs": "each choice's logprob per token",
    "choice_probs": "the choices' probabilities among themselves",
    "best_choice": "the choice with the highest summed logprob",
}


def files_info(directory: Path, shards: Sequence[str]) -> dict[str, str]:
    """The card's `dataset_info`: a description naming the data files by name, size and modification time. The
    datasets library caches a local folder whose card lists its data files by the card's metadata alone (the file
    patterns, not the files: datasets 4), so a folder rewritten in place, or another folder of the same name, would
    load the rows cached before; a description that changes with the files makes a new cache entry."""
    import hashlib

    digest = hashlib.blake2b(digest_size=8)
    for name in shards:
        stat = (Path(directory) / name).stat()
        digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return {"description": f"Rows written by cbgen (data files {digest.hexdigest()})"}


def card_text(*, shards: Sequence[str], columns: OutputColumns | None, job: dict[str, Any], model: str | None,
              counts: dict[str, Any], command: Sequence[str], in_order: bool, merged_from: int = 0,
              saved_to_disk: bool = False, directory: Path | None = None) -> str:
    """The card of an output directory whose committed shards are `shards` (file names, in order); with
    `saved_to_disk`, of a dataset written by `merge --to-dataset` (whose Arrow files the hub reads, and
    `datasets.load_from_disk` locally)."""
    kind = kind_of(columns.kind if columns is not None else None)
    meta = {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": list(shards)}]}],
        **({"dataset_info": files_info(directory, shards)} if directory is not None else {}),
        "tags": ["cbgen", "synthetic"],
        "cbgen": {
            "version": __version__,
            "model": model,
            **({"adapters": adapters} if (adapters := _adapters(job)) else {}),
            "command": shlex.join(command),
            kind.card_settings: job.get(kind.card_settings, {}),
            "templates": {k: job.get("input", {}).get(k) for k in ("template", "system", "messages")},
            "counts": counts,
            "columns": list(columns.names) if columns is not None else None,
            "input_order": in_order,
            **({"merged_from_shards": merged_from} if merged_from else {}),
        },
    }
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=120)
    rows = kind.rows_counted(counts)
    lines = [f"---\n{header}---", "", f"# {kind.card_title}", "",
             f"{rows} rows {kind.card_verb} by {model or 'a model'} with cbgen {__version__}"
             + ("" if in_order else " (in the order requests finished: the run is not complete)") + ".", "",
             *_adapter_lines(adapters),
             *_cache_lines(counts),
             "## Load", "", "```python", "import datasets", "",
             'rows = datasets.load_from_disk("THIS_FOLDER")' if saved_to_disk else
             'rows = datasets.load_dataset("THIS_FOLDER", split="train")  # or: cbgen.load("THIS_FOLDER")',
             "```", "", "## Publish", "",
             "```bash", "hf upload YOUR_NAME/YOUR_DATASET THIS_FOLDER --repo-type dataset", "```", "", "## Columns", ""]
    meanings = _MEANINGS | dict(kind.meanings)
    for name in columns.names if columns is not None else ():
        lines.append(f"- `{name}`: {meanings.get(name, 'an input column kept with --keep-columns')}")
    return "\n".join(lines) + "\n"


def _adapters(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's LoRA adapters as its stored settings name them: each one's name and source, the job's own first."""
    from cbgen.config.adapters import specs_of, split_spec
    from cbgen.model.adapters import default_name

    found = []
    for spec in specs_of((job.get("model") or {}).get("adapter")):
        name, source = split_spec(spec)
        found.append({"name": name or default_name(source), "source": source, "default": name is None})
    return sorted(found, key=lambda a: not a["default"])


def _adapter_lines(adapters: list[dict[str, Any]]) -> list[str]:
    """What the card says of the adapters the rows were generated with (run.json has their digests)."""
    if not adapters:
        return []
    named = [f"`{a['name']}` ({a['source']}{', the rows that name none' if a['default'] else ''})" for a in adapters]
    return [f"With LoRA adapters merged into the model: {', '.join(named)}.", ""]


def _cache_lines(counts: dict[str, Any]) -> list[str]:
    """What the card says of the result cache's share of the last run, when it answered some requests."""
    exact, near = counts.get("result_cache_hits", 0), counts.get("result_cache_near_hits", 0)
    if not exact and not near:
        return []
    line = f"In the last run, {exact} requests were answered from cbgen's result cache, bitwise what a fresh run gives"
    if near:
        line += f", and {near} from entries computed with other numerics (near hits, asked for with --cache-near-hits)"
    return [line + ".", ""]


def write_card(directory: Path, **details: Any) -> Path:
    """Writes the card (see `card_text` for what it takes) into `directory`, atomically."""
    path = Path(directory) / CARD_FILE
    write_text_atomic(path, card_text(directory=Path(directory), **details))
    return path


def table_card_text(*, shards: Sequence[str], columns: Sequence[str], rows: int, stage: str, query: str,
                    upstream: Sequence[str], command: Sequence[str], directory: Path) -> str:
    """The card of a pipeline's sql stage (cbgen.pipelines) in `directory`: its result is a dataset as any run's
    output is."""
    meta = {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": list(shards)}]}],
        "dataset_info": files_info(directory, shards),
        "tags": ["cbgen", "synthetic"],
        "cbgen": {"version": __version__, "command": shlex.join(command), "stage": stage, "query": query,
                  "reads": list(upstream), "counts": {"rows": rows}, "columns": list(columns)},
    }
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=120)
    lines = [f"---\n{header}---", "", "# A dataset made by a cbgen pipeline", "",
             f"{rows} rows: stage `{stage}` of a cbgen {__version__} pipeline, a DuckDB query over "
             f"{', '.join(f'`{u}`' for u in upstream) or 'no stage'}.", "", "```sql", query.strip(), "```", "",
             "## Load", "", "```python", "import datasets", "",
             'rows = datasets.load_dataset("THIS_FOLDER", split="train")  # or: cbgen.load("THIS_FOLDER")',
             "```", "", "## Publish", "",
             "```bash", "hf upload YOUR_NAME/YOUR_DATASET THIS_FOLDER --repo-type dataset", "```", "", "## Columns", "",
             *(f"- `{name}`" for name in columns)]
    return "\n".join(lines) + "\n"
