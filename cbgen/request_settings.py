"""A request's own settings: the row's (checked when read, cbgen.inputs.settings) over the job's."""

from __future__ import annotations

from cbgen.config import JobConfig
from cbgen.records import Request
from cbgen.sampling import SamplingPlan


class RequestSettings:
    """Gives a rendered request its own sampling values, max_new_tokens, number of sequences, stop strings and step
    control (format, seed, top logprobs); a row setting that cannot apply makes the request an error naming why."""

    def __init__(self, job: JobConfig, plan: SamplingPlan, steps=None) -> None:
        self.job = job
        self.plan = plan
        self.steps = steps  # cbgen.control.plan.StepPlan, or None when no step control runs

    def __call__(self, request: Request) -> Request:
        settings = request.record.settings
        g = self.job.generation
        if request.error is not None or not settings and not g.stop and self.steps is None:
            return request
        n = settings.get("n")
        if n is not None and n != g.num_return_sequences and g.num_return_sequences > 1:
            request.error = (f"the row asks for n={n}, the job for {g.num_return_sequences} sequences per prompt "
                             "(-n): rows may ask for their own n only when the job asks for one")
            return request
        sampling = self.plan.request_kwargs(settings)
        if isinstance(sampling, str):
            request.error = sampling
            return request
        if self.steps is not None:
            kwargs, request.response_format, error = self.steps.request_kwargs(request.record.id, settings, g.seed)
            if error is not None:
                request.error = error
                return request
            sampling |= kwargs
            request.top_logprobs = settings.get("top_logprobs", g.top_logprobs or 0)
        request.sampling = sampling
        request.n = n
        request.max_new_tokens = settings.get("max_new_tokens")
        request.stop = tuple(dict.fromkeys([*g.stop, *settings.get("stop", ())]))
        return request
