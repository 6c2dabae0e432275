"""Per-request sampling on transformers' continuous batching.

The manager builds its samplers once, from the GenerationConfig, and only a sampler that exists can take a
request's own value (a temperature of None or 1.0 builds no temperature stage, a top_p of 1.0 no top-p stage; see
`ContinuousBatchingLogitsProcessorList`). Sampling itself (`do_sample`) is one switch for all requests. So when rows
carry their own `temperature`, `top_p` or `top_k`, cbgen turns sampling on, builds each stage some row (or the job)
needs, and hands every request an explicit value for every stage: the job's value where the row sets none. A
greedy request (temperature 0) in such a job samples from its single most likely token (top_k = 1): the same tokens
as greedy decoding. When no row sets any of them, nothing changes: the job's sampling, no per-request stages.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any

from cbgen.config import JobConfig
from cbgen.errors import RowError
from cbgen.inputs.settings import SAMPLING_SETTINGS

# Values that make transformers build a stage; every request then passes its own value, so these never apply.
_BUILD = {"temperature": 0.5, "top_p": 0.5, "top_k": 1}


@dataclass(frozen=True)
class SamplingPlan:
    do_sample: bool  # the job's own choice
    temperature: float | None
    top_p: float | None
    top_k: int | None
    vocab_size: int
    stages: frozenset[str] = frozenset()  # per-request stages built; empty: the job's sampling for every request

    @classmethod
    def build(cls, job: JobConfig, used: Set[str], vocab_size: int) -> SamplingPlan:
        """The plan for a job whose rows use the settings `used` (see Reader.settings_present)."""
        g = job.generation
        plan = cls(job.do_sample, g.temperature, g.top_p, g.top_k, vocab_size)
        if not used & set(SAMPLING_SETTINGS):
            return plan
        stages = {name for name in SAMPLING_SETTINGS if name in used or getattr(g, name) is not None}
        if not job.do_sample or "temperature" in used:
            stages.add("top_k")  # greedy requests (the job's, or a row's temperature 0) take top_k = 1
        return cls(job.do_sample, g.temperature, g.top_p, g.top_k, vocab_size, frozenset(stages))

    @property
    def per_request(self) -> bool:
        return bool(self.stages)

    def generation_fields(self) -> dict[str, Any]:
        """do_sample, temperature, top_p and top_k for the GenerationConfig."""
        if not self.per_request:
            if not self.do_sample:
                return {"do_sample": False}
            fields: dict[str, float | int | None] = {k: v for k, v in (
                ("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k)) if v}
            fields.setdefault("top_k", None)  # transformers' default top_k=50 would silently truncate sampling
            return {"do_sample": True, **fields}
        return {"do_sample": True, **{name: _BUILD[name] if name in self.stages else None for name in _BUILD}}

    def request_kwargs(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The sampler values for a request with the row settings `settings`; RowError when they cannot apply."""
        if not self.per_request:
            if any(name in settings for name in SAMPLING_SETTINGS):  # only rows read after the plan was made
                raise self._late(next(n for n in SAMPLING_SETTINGS if n in settings))
            return {}
        temperature = settings.get("temperature")
        if temperature is None:
            temperature = (self.temperature or 1.0) if self.do_sample else 0.0
        if temperature == 0:
            values = {"temperature": 1.0, "top_p": 1.0, "top_k": 1}
        else:
            top_k = settings.get("top_k", self.top_k) or 0
            values = {"temperature": float(temperature), "top_p": float(settings.get("top_p", self.top_p) or 1.0),
                      "top_k": int(top_k or self.vocab_size)}
        neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": self.vocab_size}
        for name, value in values.items():
            if name not in self.stages and value != neutral[name]:
                raise self._late(name if name in settings else "temperature")
        return {name: value for name, value in values.items() if name in self.stages}

    @staticmethod
    def _late(name: str) -> RowError:
        flag = "--" + name.replace("_", "-")
        return RowError(f"the row sets {name}, but the sampler was built before any row using it was read (stdin): "
                        f"give the job a {flag} so it has that stage, or put such a row among the first ones")
