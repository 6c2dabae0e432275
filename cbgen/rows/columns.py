"""Which columns a job's output rows have, decided once and kept with the job.

Every row of a generation job has the base fields (cbgen.records.BASE_FIELDS). Besides them, a job's rows have:

    logprobs       when the job (--logprobs, --top-logprobs) or some row asks for logprobs
    top_logprobs   when the job (--top-logprobs) or some row asks for alternatives per token
    reasoning,     when the model's replies are split by a response template (a reasoning model, tools, or
    tool_calls     --response-template)
    parsed         when the job (--json-schema, --json-object) or some row asks for JSON: the answer as data
                   (cbgen.rows.parsed), typed by the job's schema where one schema holds for every row
    kept columns   the input columns of --keep-columns, in their order

A scoring job's rows (cbgen.kinds.score) have the score fields (cbgen.records.SCORE_FIELDS), then `token_ids`,
`logprobs` and `top_logprobs` of the scored tokens on request, then the kept columns.

The run decides this once it knows its input and model (cbgen.job.plan) and stores it in fingerprint.json, so a
resume writes the same columns and `cbgen merge`, `merge --to-dataset` and `cbgen status` read them back instead of
guessing from the job's flags. A request whose row did not ask for logprobs has them as null in a job where others
did: `wants_logprobs` says which.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.kinds import DEFAULT, Kind, kind_of, kind_of_columns

if TYPE_CHECKING:
    from cbgen.config import GenerationSection, JobConfig

JSON_KINDS = ("json_schema", "json_object")  # the formats whose answers are data


@dataclass(frozen=True)
class OutputColumns:
    logprobs: bool = False
    top_logprobs: bool = False
    replies: bool = False  # `reasoning` and `tool_calls`
    kept: tuple[str, ...] = ()
    parsed: bool = False
    parsed_schema: str | None = None  # the one JSON schema every row follows (its text), which types `parsed`
    kind: str = DEFAULT  # the job's kind (cbgen.kinds), which says the fields its rows have
    labels: tuple[str, ...] = ()  # a reward job's output columns, one per label of its model
    dimensions: int = 0  # an embed job's embedding size

    @classmethod
    def decide(cls, job: JobConfig, used: Set[str], replies: bool) -> OutputColumns:
        """The columns of `job`, whose rows carry the settings `used` (cbgen.inputs.Reader.settings_present), with
        replies split by a response template when `replies`."""
        from cbgen.chat.formats import job_format

        g = job.generation
        top = bool(g.top_logprobs) or "top_logprobs" in used
        if not kind_of(job.kind).generates:  # no output format, no replies
            return cls(logprobs=g.logprobs or top, top_logprobs=top, kept=tuple(job.input.keep_columns),
                       kind=job.kind)
        fmt = job_format(g)  # checked before any model loads (cbgen.config.build)
        rows_choose = "response_format" in used
        one_schema = fmt is not None and fmt.kind == "json_schema" and not rows_choose
        return cls(logprobs=g.logprobs or top or "logprobs" in used, top_logprobs=top, replies=replies,
                   kept=tuple(job.input.keep_columns),
                   parsed=rows_choose or (fmt is not None and fmt.kind in JSON_KINDS),
                   parsed_schema=fmt.spec if one_schema and fmt is not None else None, kind=job.kind)

    @property
    def of_kind(self) -> Kind:
        return kind_of(self.kind)

    @property
    def names(self) -> tuple[str, ...]:
        """Every column, in the order rows have them."""
        return self.of_kind.column_names(self)

    @property
    def reserved(self) -> frozenset[str]:
        """The names the rows use for their own fields, which a kept column may not take."""
        return self.of_kind.reserved_names()

    def to_dict(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs, "replies": self.replies,
                "kept": list(self.kept), "parsed": self.parsed, "parsed_schema": self.parsed_schema, "kind": self.kind,
                "labels": list(self.labels), "dimensions": self.dimensions}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OutputColumns:
        return cls(bool(data.get("logprobs")), bool(data.get("top_logprobs")), bool(data.get("replies")),
                   tuple(data.get("kept") or ()), bool(data.get("parsed")), data.get("parsed_schema"),
                   str(data.get("kind") or DEFAULT), tuple(data.get("labels") or ()), int(data.get("dimensions") or 0))

    @classmethod
    def from_names(cls, names: Set[str], kept: tuple[str, ...]) -> OutputColumns:
        """The columns of rows written before cbgen stored them: read off a shard's column names."""
        return cls("logprobs" in names, "top_logprobs" in names, "reasoning" in names,
                   tuple(name for name in kept if name in names), "parsed" in names,
                   kind=kind_of_columns(frozenset(names)).name)


def top_logprobs_of(generation: GenerationSection, settings: Mapping[str, Any]) -> int:
    """How many alternatives per token a request with the row settings `settings` gets: its row's top_logprobs,
    else the job's --top-logprobs, else none."""
    return int(settings.get("top_logprobs", generation.top_logprobs or 0))


def wants_logprobs(generation: GenerationSection, settings: Mapping[str, Any]) -> bool:
    """Whether a request with the row settings `settings` gets the logprobs of its tokens: the job asks for them
    (--logprobs), its row does, or it gets alternatives per token."""
    return generation.logprobs or bool(settings.get("logprobs")) or top_logprobs_of(generation, settings) > 0
