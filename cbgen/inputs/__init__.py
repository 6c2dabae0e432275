"""Input readers: stream `PromptRecord`s from JSONL (a file or stdin), OpenAI batch files, Parquet (a file or a
directory) and Hugging Face datasets."""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from cbgen.errors import CbgenError
from cbgen.inputs.base import Reader, ReaderOptions
from cbgen.inputs.checks import ROW_NUMBER
from cbgen.inputs.jsonl import MAX_LINE_BYTES, JsonlReader

if TYPE_CHECKING:
    from cbgen.config import InputSection
    from cbgen.inputs.scoring import ScoreFields
    from cbgen.render.templates import PromptTemplate

__all__ = ["ROW_NUMBER", "JsonlReader", "Reader", "open_input", "open_reader"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".ndjson", ".jsonl.gz", ".csv", ".arrow")
# each input format's reader (cbgen.inputs.base.Reader): its module, and the class there; adding a format is a module,
# a line here, a --input-format choice, its docs and tests
FORMATS = {"jsonl": "cbgen.inputs.jsonl:JsonlReader", "openai": "cbgen.inputs.openai:OpenAIBatchReader",
           "parquet": "cbgen.inputs.parquet:ParquetReader", "dataset": "cbgen.inputs.dataset:DatasetReader"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name: a hub dataset id, when no such local path exists


def open_input(settings: InputSection, *, path: str | None = None, detect_id: bool = True,
               score: ScoreFields | None = None) -> Reader:
    """The reader of a job's input, with the job's input settings (its templates included); `path` overrides the
    settings' own (an input that has moved since the run). `score`: the rows are a scoring job's."""
    source = path or settings.path
    if source is None:
        raise CbgenError("no input file given: cbgen run PROMPTS.jsonl (or - for stdin)")
    from cbgen.render.templates import PromptTemplate

    return open_reader(source, prompt_column=settings.prompt_column, id_column=settings.id_column,
                       keep_columns=settings.keep_columns, input_format=settings.format, split=settings.split,
                       subset=settings.subset, detect_id=detect_id, max_line_bytes=settings.max_line_bytes,
                       template=PromptTemplate.from_input(settings), score=score)


def open_reader(path: str | Path, *, prompt_column: str | None = None, id_column: str | None = None,
                keep_columns: Sequence[str] = (), input_format: str = "auto", split: str | None = None,
                subset: str | None = None, detect_id: bool = True, max_line_bytes: int = MAX_LINE_BYTES,
                template: PromptTemplate | None = None, score: ScoreFields | None = None) -> Reader:
    """Open the reader that fits `path` ("-" is JSONL on stdin) and `input_format`, checking up front what can be
    checked. `detect_id`: without `id_column`, rows carrying an `id` field are known by it (see Reader). With
    `template`, each row's prompt is made from its columns.

    Raises `CbgenError` for a missing, unreadable or unsupported file, a schema without the needed columns, or a
    kept column that would clash with an output column.
    """
    options = ReaderOptions(prompt_column, id_column, tuple(keep_columns), detect_id, template, score, split, subset,
                            max_line_bytes)
    fmt, why = input_format, f"--input-format {input_format}"
    if fmt == "auto":
        fmt, why = _detect(str(path), Path(path))
    module, name = FORMATS[fmt].split(":")  # imported on first use: pyarrow and datasets are slow to import
    reader: Reader = getattr(import_module(module), name).open(str(path), options)
    reader.detected = why
    return reader


def _detect(path: str, local: Path) -> tuple[str, str]:
    """The input's format, and why it was chosen (said in the log)."""
    if path == "-":
        return "jsonl", "standard input is read as JSONL prompt rows"
    name = local.name.lower()
    if not (local.is_file() and name.removesuffix(".gz").endswith(JSONL_SUFFIXES)):
        return _detect_other(path, local, name), "recognised from the path"
    from cbgen.inputs.openai import detect_openai_batch  # a JSONL file: its first lines tell

    openai, why = detect_openai_batch(local)
    return ("openai" if openai else "jsonl"), why


def _detect_other(path: str, local: Path, name: str) -> str:
    if local.is_file() and name.endswith(".parquet"):
        return "parquet"
    if local.is_dir():
        from cbgen.inputs.dataset import is_saved_dataset

        if is_saved_dataset(local):
            return "dataset"
        if any(local.glob("*.parquet")):
            return "parquet"  # a flat folder of Parquet files streams without the datasets library's cache
        if not any(p.is_file() and p.name.lower().endswith(DATA_SUFFIXES) for p in local.rglob("*")):
            raise CbgenError(f"input directory '{path}' contains no data files ({', '.join(DATA_SUFFIXES)}) and is "
                             "not a dataset saved with save_to_disk")
        return "dataset"  # a dataset folder: the datasets library reads its files and split layout
    if not local.exists():
        if HUB_ID.match(path) and not name.endswith((*JSONL_SUFFIXES, ".parquet", ".gz")):
            return "dataset"
        raise CbgenError(f"input file '{path}' does not exist")
    raise CbgenError(f"cannot read '{path}': unsupported input format; use a .jsonl, .json or .ndjson file "
                     "(optionally .gz; OpenAI batch files too), a .parquet file, a folder of Parquet files or a "
                     "Hugging Face dataset (saved with save_to_disk, a dataset folder, or a hub id), or - for JSONL "
                     "on stdin")
