"""The frozen plan a job hands its engine, and the engine's replicas: everything the run decided before its engine
starts. Made by cbgen.job.plan (the only place a plan is decided); kept here, beside the engine that runs it, so that
the rooms reading it (the replicas, the result cache, the run's summary) read down to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cbgen.chat.responses import ResponseTemplate
    from cbgen.control.needs import StepPlan
    from cbgen.control.sampling import SamplingPlan
    from cbgen.engine.kv_sizing import WorkloadShape
    from cbgen.engine.setup import EnginePlan
    from cbgen.inputs.base import IdChoice
    from cbgen.render.prompts import RenderPlan
    from cbgen.rows.columns import OutputColumns


@dataclass(frozen=True)
class JobPlan:
    """Everything the run of a job decided before its engine starts."""

    template: ResponseTemplate | None  # how replies split into reasoning, tool calls and content
    render: RenderPlan  # how records become token ids
    sampling: SamplingPlan  # per-request sampler stages
    steps: StepPlan | None  # the step control (formats, own logprobs, seeded draws); None: transformers' alone
    workload: WorkloadShape  # what the engine is sized for
    engine: EnginePlan  # the engine's configuration, KV cache and settings
    columns: OutputColumns  # which columns the rows have
    ids: IdChoice  # where request ids come from
