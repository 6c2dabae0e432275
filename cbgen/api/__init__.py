"""The Python API: what a notebook or a pipeline calls instead of the command line.

    results = cbgen.generate(["Why is the sky blue?"], max_new_tokens=64)         # load, generate, free
    with cbgen.Generator(model="Qwen/Qwen3-4B", page_size=128) as gen:           # load once...
        a = gen.generate(rows, template="Write about {{ topic }}.", json_schema=schema)
        b = gen.generate(more, temperature=0.7, seed=1)                          # ...generate again and again
    summary = cbgen.run("prompts.jsonl", "out/", max_new_tokens=512)              # `cbgen run`, resumable
    report = cbgen.pipeline("pipeline.yaml", "out/")                              # `cbgen pipeline`, like make
    rows = cbgen.load("out/")                                                    # a datasets.Dataset, input order
    vectors = cbgen.embed(["a text", "another"])                     # float32 [rows, dim], all-MiniLM-L6-v2

Keyword names are the YAML keys of a job (`max_new_tokens`, `temperature`, `json_schema`, `page_size`, ...;
`input_format` and `output_format` for the two `format` keys), checked exactly as flags are; an unknown one raises
TypeError naming the closest. They are typed (cbgen.api.settings, generated from the settings table that feeds
`--help`), so editors complete them and mypy checks them. Prompts are strings, chat message lists, row dicts
(templates apply to them) or a `datasets.Dataset`. Nothing here imports torch until a model is needed. Mistakes the
caller can fix raise cbgen.CbgenError, whose message says what to change.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.config import SECTIONS, build_config
from cbgen.config.flat import keyword_overrides
from cbgen.job.sequence import generate_in_memory
from cbgen.parallel.launch import launch_of
from cbgen.progress import NullProgress, ProgressSink

if TYPE_CHECKING:
    import datasets
    from typing_extensions import Unpack

    from cbgen.api.settings import CallSettings, JobSettings
    from cbgen.model.load import LoadedModel
    from cbgen.outputs.summary import RunSummary
    from cbgen.pipelines.runner import PipelineReport

@dataclass
class Result:
    """One returned sequence of one prompt."""

    id: str
    sample_index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[dict[str, Any]]] | None = None
    parsed: Any = None  # the JSON value, for JSON formats
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    num_prompt_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # kept columns

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Result:
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in row.items() if k in known},
                   extra={k: v for k, v in row.items() if k not in known and k != "num_generated_tokens"})


def _progress(show: bool | None) -> ProgressSink:
    """A progress bar where someone is looking (a terminal, a notebook) or when asked; else nothing."""
    if show is None:
        show = sys.stderr.isatty() or "ipykernel" in sys.modules
    if not show:
        return NullProgress()
    from cbgen.progress import BarProgress

    return BarProgress()


class Generator:
    """A model loaded once, to generate for prompts again and again in one session. Takes the model's settings
    (`model`, `dtype`, `device`, ...) and any job setting as defaults for its calls. `close()` (or leaving a `with`
    block) frees its memory."""

    def __init__(self, model: str | None = None, *, progress: bool | None = None,
                 **settings: Unpack[JobSettings]) -> None:
        self._defaults = keyword_overrides(settings)
        if model is not None:
            self._defaults[("model", "model")] = (model, "model")
        self._job = build_config(None, self._defaults)
        self.progress = progress
        self._loaded: LoadedModel | None = None

    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            from cbgen.model.adapters import job_adapters
            from cbgen.model.load import load_model
            from cbgen.model.source import resolve_source

            resolve_source(self._job.model.model)  # a model that cannot be found says so before torch loads
            job_adapters(self._job)  # an adapter that cannot be found too (load_model checks that each fits)
            self._loaded = load_model(self._job.model)
        return self._loaded

    def generate(self, prompts: Sequence[Any] | datasets.Dataset, *, progress: bool | None = None,
                 **settings: Unpack[CallSettings]) -> list[Result]:
        """The results for `prompts`, in input order (a prompt's sequences by sample index). Model settings are
        the Generator's own: give them to its constructor."""
        overrides = self._defaults | keyword_overrides(settings, set(SECTIONS) - {"model"},
                                                " here: it is a model setting, given to cbgen.Generator(...)")
        job = build_config(None, overrides)
        launch_of(job, "the Python API")
        rows = generate_in_memory(job, self.loaded, prompts,
                                  _progress(self.progress if progress is None else progress))
        return [Result.from_row(row) for row in rows]

    def close(self) -> None:
        """Frees the model (and, on a GPU, its memory)."""
        if self._loaded is None:
            return
        self._loaded = None
        import gc

        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def generate(prompts: Sequence[Any] | datasets.Dataset, *, model: str | None = None, progress: bool | None = None,
             **settings: Unpack[JobSettings]) -> list[Result]:
    """Loads the model, generates for `prompts` (in input order), and frees it: `Generator(...).generate(...)`."""
    with Generator(model, progress=progress, **settings) as generator:
        return generator.generate(prompts)


class Embedder:
    """An embedding model loaded once (the embedded all-MiniLM-L6-v2 unless `model` names another), to embed texts
    again and again. Takes the model's settings and the embed section's (`pooling`, `normalize`, `max_length`,
    `batch_tokens`, `text_column`, `template`)."""

    def __init__(self, model: str | None = None, **settings: Unpack[JobSettings]) -> None:
        overrides = keyword_overrides(settings, own_section="embed")
        if model is not None:
            overrides[("model", "model")] = (model, "model")
        self._job = build_config(None, overrides, kind="embed")
        launch_of(self._job, "the Python API")
        from cbgen.model.source import resolve_source

        resolve_source(self._job.model.model, "embedder")  # a model that cannot be found says so before torch loads
        from cbgen.encoders.load import load_encoder

        self.loaded = load_encoder(self._job)

    def embed(self, texts: Sequence[Any] | datasets.Dataset, *, progress: bool | None = None) -> Any:
        """A float32 numpy array [len(texts), dimensions], in input order. Texts are strings (or row dicts, whose
        text field or template makes the text). A row that cannot be embedded raises CbgenError naming it."""
        import numpy as np

        from cbgen.errors import CbgenError
        from cbgen.job.encode import encode_in_memory

        rows = encode_in_memory(self._job, self.loaded, texts, _progress(progress))
        bad = next((row for row in rows if row["error"] is not None), None)
        if bad is not None:
            raise CbgenError(bad["error"])
        return np.asarray([row["embedding"] for row in rows], dtype=np.float32).reshape(len(rows), -1)


def embed(texts: Sequence[Any] | datasets.Dataset, *, model: str | None = None, progress: bool | None = None,
          **settings: Unpack[JobSettings]) -> Any:
    """Loads the embedding model, embeds `texts` (a float32 numpy array, input order) and frees it."""
    return Embedder(model, **settings).embed(texts, progress=progress)


def run(input: str | Path, output_dir: str | Path, *, model: str | None = None, progress: bool | None = None,
        **settings: Unpack[JobSettings]) -> RunSummary:
    """`cbgen run INPUT -o OUTPUT_DIR`: the whole job, written to sharded files; resumable, as the command is."""
    from cbgen.job.run import run_job

    named = {("input", "path"): (str(input), "input"), ("output", "dir"): (str(output_dir), "output_dir")}
    overrides = keyword_overrides({**settings, **({"model": model} if model is not None else {})}) | named
    return run_job(build_config(None, overrides), _progress(progress))


def load(output_dir: str | Path) -> datasets.Dataset:
    """A run's rows (or a merged job's) as a datasets.Dataset, in input order."""
    from cbgen.outputs.dataset import load as load_dataset

    return load_dataset(output_dir)


def pipeline(file: str | Path | Mapping[str, Any], output_dir: str | Path, *, stage: str | None = None,
             redo: Sequence[str] | None = None, progress: bool | None = None) -> PipelineReport:
    """`cbgen pipeline FILE -o OUTPUT_DIR`: a pipeline file, or its contents as a dict (relative paths then start
    from the working directory); each stage into OUTPUT_DIR/<name>/, resumable as the command is. `stage` runs one
    stage alone; `redo` (failed, length) applies to the stages run. Raises cbgen.errors.CbgenError for a bad
    pipeline, before any model loads."""
    from cbgen.pipelines import load_pipeline
    from cbgen.pipelines.runner import PipelineRun

    extra = {("run", "redo"): (list(redo), "redo")} if redo else {}
    show = _progress(progress)
    run = PipelineRun(load_pipeline(file), Path(output_dir), only=stage, extra=extra, progress=lambda _: show)
    return run.run()
