"""A request's own settings: the row's (checked when read, cbgen.inputs.settings) over the job's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cbgen.config import JobConfig
from cbgen.errors import RowError
from cbgen.records import PromptRecord, Request
from cbgen.rows.columns import top_logprobs_of

if TYPE_CHECKING:
    from cbgen.control.grammars import Grammars
    from cbgen.engine.job_plan import JobPlan


class RequestSettings:
    """Gives a rendered request its own sampling values, max_new_tokens, number of sequences, stop strings and step
    control (format, seed, top logprobs), as the job's plan says. A row setting that cannot apply makes the request
    an error naming why: every check below raises RowError, caught here, once."""

    def __init__(self, job: JobConfig, plan: JobPlan, grammars: Grammars | None = None) -> None:
        self.job = job
        self.plan = plan
        self.grammars = grammars  # the job's compiled formats, when some request follows one

    def __call__(self, request: Request) -> Request:
        g = self.job.generation
        if request.error is not None:
            return request
        try:
            if self.plan.engine.settings.adapters is not None or "adapter" in request.record.settings:
                request.adapter = self._adapter(request.record)
            if request.record.settings or g.stop or self.plan.steps is not None:
                self._apply(request)
        except RowError as e:
            request.error = str(e)
        return request

    def _adapter(self, record: PromptRecord) -> str | None:
        """The adapter the row names by its `adapter` field (one of the job's, else the row is refused), or an
        OpenAI batch line by its body's `model` (when the job has an adapter of that name; else its own model)."""
        adapters = self.plan.engine.settings.adapters
        named = record.settings.get("adapter")
        if adapters is None:
            raise RowError(f"the row names adapter {named!r}, and the job has none: give it with --adapter "
                           f"{named}=PATH")
        if named is not None:
            try:
                adapters.pick(named)
            except KeyError:
                raise RowError(f"the row names adapter {named!r}, not one of the job's ({', '.join(adapters.names())})"
                               f": give it with --adapter {named}=PATH") from None
            return str(named)
        return record.model if record.model in adapters.names() else None

    def _apply(self, request: Request) -> None:
        settings = request.record.settings
        g = self.job.generation
        n = settings.get("n")
        if n is not None and n != g.num_return_sequences and g.num_return_sequences > 1:
            raise RowError(f"the row asks for n={n}, the job for {g.num_return_sequences} sequences per prompt (-n): "
                           "rows may ask for their own n only when the job asks for one")
        sampling = self.plan.sampling.request_kwargs(settings)
        steps = self.plan.steps
        if steps is not None:
            cap = settings.get("max_new_tokens", g.max_new_tokens)
            kwargs, request.response_format = steps.request_kwargs(request.record.id, settings, g.seed, self.grammars,
                                                                   cap)
            sampling |= kwargs
            request.top_logprobs = top_logprobs_of(g, settings)
        request.sampling = sampling
        request.n = n
        request.max_new_tokens = settings.get("max_new_tokens")
        request.stop = tuple(dict.fromkeys([*g.stop, *settings.get("stop", ())]))
        request.min_tokens = int(settings.get("min_tokens", g.min_tokens or 0))
