"""The steps of a job run by an encoding model (embed, reward), in the place of the engine's: its rows rendered
into token ids for the model, its output columns (the embedding's size, the reward model's labels), the encoder."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cbgen.config import JobConfig
from cbgen.encoders.encoder import Encoder
from cbgen.encoders.load import LoadedEncoder
from cbgen.encoders.requests import EncodeRenderer
from cbgen.encoders.rows import EncodedRows
from cbgen.progress import ProgressSink
from cbgen.records import Completion, PromptRecord, Request
from cbgen.rows.columns import OutputColumns


@dataclass
class PlannedEncoding:
    columns: OutputColumns
    requests: Iterator[Request]
    rows: EncodedRows
    encoder: Encoder


def plan_encoding(job: JobConfig, loaded: LoadedEncoder, records: Iterator[PromptRecord]) -> PlannedEncoding:
    columns = encoded_columns(job, loaded)
    embed = loaded.pooling is not None
    renderer = EncodeRenderer(loaded, conversations=not embed, template_kwargs=job.generation.chat_template_kwargs)
    section = job.embed if embed else job.reward
    return PlannedEncoding(columns, renderer.render_all(records), EncodedRows(columns, loaded.label_names),
                           Encoder(loaded, section.batch_tokens, packed_batches=getattr(section, "packed", False)))


def encoded_columns(job: JobConfig, loaded: LoadedEncoder | None) -> OutputColumns:
    """The job's columns, with what the model decides of them (None: no model loaded, every row refused)."""
    columns = OutputColumns.decide(job, frozenset(), replies=False)
    if loaded is None:
        return columns
    if loaded.pooling is not None:
        return replace(columns, dimensions=int(loaded.model.config.hidden_size))
    return replace(columns, labels=loaded.labels)


def encode_in_memory(job: JobConfig, loaded: LoadedEncoder, items: Sequence[Any], progress: ProgressSink
                     ) -> list[dict[str, Any]]:
    """Every row for `items` (strings, message lists, row dicts or a datasets.Dataset) encoded on `loaded`, with no
    file read or written, in input order."""
    from cbgen.inputs.memory import MemoryReader
    from cbgen.inputs.scoring import ScoreFields
    from cbgen.job.sequence import drain, open_job_input
    from cbgen.model.source import context_tokens
    from cbgen.render.templates import PromptTemplate

    reader = MemoryReader(items, keep_columns=job.input.keep_columns, id_column=job.input.id_column,
                          template=PromptTemplate.from_input(job.input), score=ScoreFields.of(job))
    open_job_input(job, context_tokens(loaded.source), reader=reader)
    planned = plan_encoding(job, loaded, iter(reader))
    found: dict[int, dict[str, Any]] = {}

    def keep(group: list[Completion]) -> None:
        found[group[0].request.record.index] = planned.rows(group)[0]

    progress.start(reader.count(), "row", "embedding" if loaded.pooling is not None else "rating")
    drain(planned.encoder.run(planned.requests, threading.Event()), progress, keep, unit="row")
    progress.finish()
    return [found[i] for i in sorted(found)]
