"""Planning a job: every decision about how it runs, made once, into one frozen JobPlan.

    job (JobConfig) ─┐
    model (loaded)  ─┼─ plan_rendering ─▶ RenderPlan ──▶ the requests read ahead, rendered ─┐
                     │                                                                     ▼
    input (Reader) ──┴──────────────────── InputFacts (row settings used, head, count, ids) ─▶ plan_job ─▶ JobPlan

Both steps are pure: they read the job, the input's facts and the model's configuration and tokenizer, and build
plain data. The run (cbgen.job.run) executes a plan; tensor-parallel followers receive rank 0's plan and
--data-parallel replicas theirs; `cbgen bench` builds its plans the same way, so what is measured is what runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.config import JobConfig
from cbgen.control.needs import StepPlan
from cbgen.control.sampling import SamplingPlan
from cbgen.engine.job_plan import JobPlan
from cbgen.inputs.base import IdChoice
from cbgen.records import PromptRecord, Request
from cbgen.render.prompts import RenderPlan
from cbgen.rows.columns import OutputColumns

if TYPE_CHECKING:
    from cbgen.chat.responses import ResponseTemplate
    from cbgen.model.load import LoadedModel


@dataclass(frozen=True)
class InputFacts:
    """What the input holds, as far as planning needs to know."""

    used: frozenset[str]  # the row settings some row carries (cbgen.inputs.settings.ROW_SETTINGS)
    head: tuple[Request, ...]  # the requests read ahead (at most cbgen.render.prompts.LOOKAHEAD), rendered
    total: int | None  # requests the run has to do; None when unknown (stdin)
    whole: bool  # the head is all of them
    ids: IdChoice
    grows_by: int = 0  # tokens a prompt may gain after its first request (a conversation's later turns)


@dataclass(frozen=True)
class RenderingPlan:
    """How records become token ids, and how replies are split back: decided from the job and the model alone."""

    template: ResponseTemplate | None  # the model's response template (None: replies stay whole text)
    render: RenderPlan


def response_template(job: JobConfig, tokenizer: Any, config: Any) -> ResponseTemplate | None:
    """The response template a job's replies are parsed with: --response-template, else the tokenizer's own, else
    transformers' fallback for the model type (cbgen.chat.responses); None: replies stay whole text."""
    from cbgen.chat.responses import load_template, model_template

    chosen = load_template(job.generation.response_template)
    return model_template(tokenizer, getattr(config, "model_type", None), chosen)


def plan_columns(job: JobConfig, used: Set[str], template: ResponseTemplate | None) -> OutputColumns:
    """The columns of a job's rows: what a run writes, and what a pipeline plans its later stages on."""
    return OutputColumns.decide(job, used, replies=template is not None)


def plan_rendering(job: JobConfig, loaded: LoadedModel) -> RenderingPlan:
    """The response template the job's replies are parsed with, and how its records are rendered."""
    template = response_template(job, loaded.tokenizer, loaded.model.config)
    text = loaded.model.config.get_text_config()
    render = RenderPlan(vocab_size=text.vocab_size, raw_prompts=job.input.raw_prompts,
                        max_positions=getattr(text, "max_position_embeddings", None),
                        template_kwargs=dict(job.generation.chat_template_kwargs),
                        finds_calls=template is not None and template.calls)
    return RenderingPlan(template, render)


def plan_job(job: JobConfig, facts: InputFacts, loaded: LoadedModel, rendering: RenderingPlan) -> JobPlan:
    """The plan of `job` over an input with `facts`, on `loaded`, whose head was rendered as `rendering` says."""
    vocab_size = loaded.model.config.get_text_config().vocab_size
    columns = plan_columns(job, facts.used, rendering.template)
    sampling = SamplingPlan.build(job, facts.used, vocab_size)
    do_sample = bool(sampling.generation_fields()["do_sample"])
    steps = StepPlan.decide(job, facts.used, columns, do_sample, vocab_size, rendering.template,
                            own_draws=loaded.device == "cpu" and job.model.tp_size == 1)
    from cbgen.engine.kv_sizing import WorkloadShape
    from cbgen.engine.setup import plan_engine  # torch: needed once there is a model to plan for

    workload = WorkloadShape.of(job, facts.head, facts.total, whole=facts.whole, grows_by=facts.grows_by)
    engine = plan_engine(job, loaded, workload, sampling, steps, job.run.data_parallel)
    return JobPlan(rendering.template, rendering.render, sampling, engine.settings.spec.control, workload, engine,
                   columns, facts.ids)


def used_settings(present: Set[str] | None, head: Iterable[PromptRecord]) -> frozenset[str]:
    """The row settings a job's rows carry: what the reader found (`present`), or, where it cannot know up front
    (stdin), those of the rows read ahead."""
    if present is not None:
        return frozenset(present)
    return frozenset(name for record in head for name in record.settings)
