"""What a job asks of the step control, decided before its engine starts: whether any request follows a format,
wants the model's own logprobs or top logprobs, or draws with a seed; and, per request, the values that travel with
it to the engine."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from cbgen.config import JobConfig
from cbgen.control.grammars import Grammars
from cbgen.formats import ResponseFormat, job_format
from cbgen.inputs.settings import MAX_TOP_LOGPROBS


@dataclass
class StepPlan:
    job_format: ResponseFormat | None
    grammars: Grammars | None  # when the job or some row has a format
    do_sample: bool  # the engine samples (the job does, or rows bring their own sampling)
    capture: bool  # record the model's own logprob of each token
    top_logprobs: int  # alternatives recorded per token (0: none)
    seeds: bool  # the job or some row gives a seed

    @classmethod
    def build(cls, job: JobConfig, used: set[str], tokenizer: Any, vocab_size: int, do_sample: bool,
              response_template: dict | None = None) -> StepPlan:
        """`used`: the row settings the input carries (Reader.settings_present); `response_template`: the model's,
        which says how it writes tool calls (for required ones)."""
        g = job.generation
        fmt = job_format(g)
        grammars = (Grammars(tokenizer, vocab_size, response_template)
                    if fmt is not None or "response_format" in used else None)
        top = g.top_logprobs or (MAX_TOP_LOGPROBS if "top_logprobs" in used else 0)
        capture = g.logprobs or top > 0 or bool({"logprobs", "top_logprobs"} & used)
        return cls(fmt, grammars, do_sample, capture, top, g.seed is not None or "seed" in used)

    @property
    def active(self) -> bool:
        """Whether the engine needs cbgen's step control at all; without it, generation is transformers' alone."""
        return self.grammars is not None or self.capture or (self.seeds and self.do_sample)

    def spec(self, vocab_size: int):
        from cbgen.control.processor import ControlSpec

        return ControlSpec(vocab_size=vocab_size, do_sample=self.do_sample, capture=self.capture,
                           top_logprobs=self.top_logprobs, grammars=self.grammars is not None,
                           response_template=self.grammars.response_template if self.grammars else None)

    def request_kwargs(self, record_id: str, settings: dict[str, Any], job_seed: int | None
                       ) -> tuple[dict[str, Any], ResponseFormat | None, str | None]:
        """The processor kwargs of one request, its format, and why it cannot run (a format that does not
        compile) or None."""
        from cbgen.control.processor import GRAMMAR_KWARG, SEED_KWARG

        kwargs: dict[str, Any] = {}
        fmt = settings.get("response_format", self.job_format)
        if fmt is not None:
            error = self.grammars.check(fmt)
            if error is not None:
                return {}, None, error
            kwargs[GRAMMAR_KWARG] = fmt.key
        seed = settings.get("seed", job_seed)
        if seed is not None and self.active and self.do_sample:
            kwargs[SEED_KWARG] = request_seed(seed, record_id)
        return kwargs, fmt, None


def request_seed(seed: int, record_id: str) -> int:
    """A request's own seed, from the job's or row's seed and its input id: the same for the same row wherever and
    whenever it runs."""
    digest = hashlib.blake2b(f"{seed}\x1f{record_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
