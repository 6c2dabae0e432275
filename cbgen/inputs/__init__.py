"""Input readers: stream `PromptRecord`s from JSONL (a file or stdin), OpenAI batch files, Parquet (a file or a
directory) and Hugging Face datasets."""

from __future__ import annotations

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

# each input format's reader (cbgen.inputs.base.Reader): its module, and the class there, in the order in which they
# detect a path's format (`Reader.detect`); adding a format is a module, a line here, a --input-format choice, its
# docs and tests
FORMATS = {"jsonl": "cbgen.inputs.jsonl:JsonlReader", "openai": "cbgen.inputs.openai:OpenAIBatchReader",
           "parquet": "cbgen.inputs.parquet:ParquetReader", "dataset": "cbgen.inputs.dataset:DatasetReader"}


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
    reader = reader_class(fmt).open(str(path), options)
    reader.detected = why
    return reader


def reader_class(fmt: str) -> type[Reader]:
    """The reader of the input format `fmt`, its module imported on first use (pyarrow and datasets are slow to
    import, and a JSONL job does without them)."""
    module, name = FORMATS[fmt].split(":")
    found: type[Reader] = getattr(import_module(module), name)
    return found


def _detect(path: str, local: Path) -> tuple[str, str]:
    """The input's format, and why it was chosen (said in the log): the first reader of FORMATS whose format tells."""
    for fmt in FORMATS:
        found = reader_class(fmt).detect(path, local)
        if found is not None:
            return found
    if not local.exists():
        raise CbgenError(f"input file '{path}' does not exist")
    raise CbgenError(f"cannot read '{path}': unsupported input format; use a .jsonl, .json or .ndjson file "
                     "(optionally .gz; OpenAI batch files too), a .parquet file, a folder of Parquet files or a "
                     "Hugging Face dataset (saved with save_to_disk, a dataset folder, or a hub id), or - for JSONL "
                     "on stdin")
