"""What a stage kind is: the one description every other module asks instead of comparing kind names.

A kind says which settings its stages take, which columns its rows have and what they mean (for the dataset card),
what of its job goes into the fingerprint, how its summary counts and reads, and whether it runs over input rows
through the model (generate, score) or as a query over earlier stages' tables (sql). The modules that run, write,
plan and show a job read these answers; none of them names a kind.

This module and the kinds' own import only cbgen's bottom layer (records, errors, progress), not even for types, so
that any room may ask them without an import running back up: a hook's `job` is a cbgen.config.JobConfig, its
`columns` a cbgen.rows.columns.OutputColumns, its `summary` a cbgen.outputs.summary.RunSummary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from cbgen.progress import plural

# the settings sections every kind that runs over rows takes (model, input, output, run)
COMMON_SECTIONS = frozenset({"model", "input", "output", "run", "batching", "cache", "attention"})


class Kind:
    """One kind of stage. Subclasses set the class attributes and override the hooks that differ."""

    name: ClassVar[str]
    over_rows: ClassVar[bool] = True  # a job over input rows through a model; False: a query over stages' tables
    generates: ClassVar[bool] = True  # its model writes text (generation settings, formats, replies apply)
    own_section: ClassVar[str | None] = None  # the settings section only this kind's stages take
    # generation settings its stages take: None for every one of them
    generation_keys: ClassVar[frozenset[str] | None] = None
    several_samples: ClassVar[bool] = False  # a row may have several sequences (sample_index 0..n-1)
    card_title: ClassVar[str] = ""
    card_verb: ClassVar[str] = ""  # "answered", "scored": "N rows <verb> by MODEL"
    starting: ClassVar[str] = "starting the engine"  # what the progress display says as its rows start
    card_settings: ClassVar[str] = "generation"  # the job section the card's metadata shows
    meanings: ClassVar[Mapping[str, str]] = {}  # what its own columns mean (over the shared meanings)
    embedded: ClassVar[str | None] = "generator"  # the embedded model a job without --model takes (None: none)
    # what runs its rows: "engine" (continuous batching), "scorer" (cbgen.score), "encoder" (cbgen.encoders); a
    # stage over tables: "query" (cbgen.pipelines.sql)
    runner: ClassVar[str] = "engine"
    drops_duplicates: ClassVar[bool] = False  # a stage over a table that drops its duplicates (cbgen.pipelines.dedup)
    # what its rows may give besides a prompt (cbgen.inputs.scoring): "choices", "completion", "text"; and whether
    # a row with a prompt must have a completion (score) or may be its prompt alone (reward: a conversation)
    reads: ClassVar[tuple[str, ...]] = ()
    completion_required: ClassVar[bool] = False
    verb: ClassVar[str] = "generating"  # the progress display's
    raw_prompts: ClassVar[bool] = False  # its rows' prompts are text as it is (a template makes text, not a turn)
    command: ClassVar[str | None] = None  # the command that runs a job of this kind alone, if one does
    # what the progress display counts when a row is not one sequence (or one row of a kind that generates nothing)
    unit: ClassVar[str | None] = None
    # LoRA adapters (cbgen.model.adapters) its stages take: "rows" (the job's, and others its rows pick by name),
    # "job" (the job's only: every row runs with it), or "" (none: its model is not one PEFT adapts for it here)
    adapters: ClassVar[str] = "job"

    def check(self, job: Any) -> None:
        """Raises cbgen.errors.CbgenError for settings of `job` that are each valid but do not go together for this
        kind (checked with the job's other combinations, before any model loads)."""

    # -- settings ------------------------------------------------------------------------------------------------

    def setting_error(self, section: str, key: str, own_sections: frozenset[str]) -> str | None:
        """Why a stage of this kind may not set `key` (of job section `section`), or None. `own_sections`: the
        sections some kind owns (a stage takes only its own of them)."""
        if section in own_sections and section != self.own_section:
            return f"{key!r} applies to {section} stages, not to a {self.name} stage"
        if section == "generation" and self.generation_keys is not None and key not in self.generation_keys:
            return f"{key!r} is a generation setting; a {self.name} stage generates nothing"
        return None

    def default_applies(self, section: str, key: str, own_sections: frozenset[str]) -> bool:
        """Whether a pipeline's `defaults` key reaches a stage of this kind."""
        return self.setting_error(section, key, own_sections) is None

    def takes_section(self, section: str) -> bool:
        """Whether the settings of job section `section` shape its rows (the score section: what is scored)."""
        return section == self.own_section or (section == "generation" and self.generates)

    # -- its rows ------------------------------------------------------------------------------------------------

    def column_names(self, columns: Any) -> tuple[str, ...]:
        """Every column of its rows, in the order rows have them."""
        raise NotImplementedError

    def reserved_names(self) -> frozenset[str]:
        """The names its rows use for their own fields, which a kept column may not take."""
        raise NotImplementedError

    def identifies(self, columns: set[str] | frozenset[str]) -> bool:
        """Whether rows with these column names (written before cbgen stored their kind) are this kind's."""
        return False

    def sample_column(self) -> str:
        """The SQL expression of a row's sample index."""
        return "sample_index" if self.several_samples else "0"

    # -- its job -------------------------------------------------------------------------------------------------

    def fingerprint(self, job: Any, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """The job's fingerprint (cbgen.outputs.manifest) with what this kind makes of it."""
        return fingerprint

    def samples_per_row(self, job: Any) -> int:
        return job.generation.num_return_sequences if self.several_samples else 1

    def redo_kinds(self, kinds: list[str]) -> list[str]:
        """The --redo selections (failed, length, ...) that apply to its rows."""
        return kinds

    # -- its summary ---------------------------------------------------------------------------------------------

    def counts(self, summary: Any) -> dict[str, int]:
        """The summary's counts, as run.json and the card store them."""
        raise NotImplementedError

    def rows_counted(self, counts: Mapping[str, Any]) -> Any:
        """How many rows its output holds, read from its counts (run.json's); "?" when they do not say."""
        return counts.get("sequences", counts.get("rows", "?"))

    def summary_rows(self, summary: Any, duration: Any, cache_line: Any) -> list[tuple[str, str]]:
        """The end-of-run summary's lines (label, value); `duration` and `cache_line` format seconds and the
        result cache's share."""
        raise NotImplementedError

    @staticmethod
    def timings_row(summary: Any, duration: Any, work: str) -> tuple[str, str]:
        """The summary's line of model load, `work` (generation, scoring) and total time."""
        return (f"model load / {work} / total", " / ".join(duration(summary.timings.get(k, 0.0))
                                                          for k in ("model_load_s", "generation_s", "total_s")))

    @staticmethod
    def output_row(summary: Any) -> tuple[str, str]:
        """The summary's line of where the rows went."""
        return ("output", f"{summary.output_dir} ({plural(len(summary.shards), 'shard')} + run.json)")

    @property
    def summary_title(self) -> str:
        return f"cbgen {self.name} summary"


class EncoderKind(Kind):
    """A kind whose rows go through an encoding model once each (cbgen.encoders: embed, reward): no generation,
    nothing cut, one row per input row."""

    generates = False
    runner = "encoder"
    adapters = ""
    work: ClassVar[str] = ""  # the summary's name of the work: "embedding", "rating"
    pooled: ClassVar[bool] = False  # its model's token vectors pooled into one (embed); else a classifier's outputs

    def redo_kinds(self, kinds: list[str]) -> list[str]:
        return [k for k in kinds if k != "length"]  # nothing is cut by a token cap

    def counts(self, summary: Any) -> dict[str, int]:
        return {"rows": summary.requests, "failed": summary.failed, "succeeded": summary.succeeded,
                "tokens": summary.prompt_tokens, "resumed_rows": summary.resumed_requests}

    def summary_rows(self, summary: Any, duration: Any, cache_line: Any) -> list[tuple[str, str]]:
        seconds = summary.generation_seconds or float("nan")
        passes = summary.scorer.get("forward_passes", 0)
        return [
            ("model", str(summary.model)),
            (f"rows {self.card_verb} / failed", f"{summary.succeeded} / {summary.failed}"),
            ("tokens read", f"{summary.prompt_tokens:,}"),
            ("rows/s, tokens/s", f"{summary.run_requests / seconds:,.1f}, {summary.run_prompt_tokens / seconds:,.0f}"),
            self.timings_row(summary, duration, self.work),
            ("forward passes", f"{passes:,} ({summary.scorer.get('padding_share', 0.0):.1%} of their tokens padding)"),
            self.output_row(summary),
        ]
