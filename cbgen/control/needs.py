"""What a job asks of the step control, decided before its engine starts: whether any request follows a format,
records the model's own logprobs or top logprobs, or draws with a seed; and, per request, the values that travel with
it to the engine.

A StepPlan is plain data: tensor-parallel followers and --data-parallel replicas receive rank 0's and build the same
step control from it (`StepPlan.control`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.chat.formats import FormatError, ResponseFormat, job_format
from cbgen.config import JobConfig
from cbgen.errors import CbgenError, RowError
from cbgen.inputs.settings import CONTROL_SETTINGS, MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from cbgen.chat.responses import ResponseTemplate
    from cbgen.control.grammars import Grammars
    from cbgen.control.processor import StepControl
    from cbgen.rows.columns import OutputColumns


@dataclass(frozen=True)
class StepPlan:
    vocab_size: int
    job_format: ResponseFormat | None
    formats: bool  # the job or some row follows a format: the job compiles grammars
    do_sample: bool  # the engine samples (the job does, or rows bring their own sampling)
    capture: bool  # record the model's own logprob of each token
    top_logprobs: int  # alternatives recorded per token (0: none)
    seeds: bool  # the job or some row gives a seed
    response_template: ResponseTemplate | None = None  # the model's: how it writes tool calls (required ones)
    history: dict[str, Any] | None = None  # the job's history controls (cbgen.control.penalties), when some request
    # has one (the job or a row)
    eos: tuple[int, ...] = ()  # the end-of-sequence ids (min_tokens, ignore_eos and the loop stop hold them back)

    @classmethod
    def decide(cls, job: JobConfig, used: Set[str], columns: OutputColumns, do_sample: bool, vocab_size: int,
               response_template: ResponseTemplate | None = None, own_draws: bool = False) -> StepPlan | None:
        """The step control a job needs, or None when it needs none (generation is then transformers' alone).
        `used`: the row settings its input carries; `columns`: what its rows record (logprobs, top logprobs);
        `own_draws`: cbgen draws every sampled token itself, seeded or not (on CPU in one process: transformers'
        own draw, a softmax and torch.multinomial over the vocabulary, took 130 ms of a 64-sequence step there, where
        cbgen's compiled inverse-CDF draw takes 1.4 ms, its eager one 7; with tensor parallelism every rank must draw
        alike, and on a GPU the step control would turn CUDA graphs off)."""
        g = job.generation
        try:
            fmt = job_format(g)
        except FormatError as e:  # checked before any model loads (cbgen.config.build): a library caller's job
            raise CbgenError(str(e)) from None
        top = g.top_logprobs or (MAX_TOP_LOGPROBS if "top_logprobs" in used else 0)
        history = job_controls(job, vocab_size)
        plan = cls(vocab_size, fmt, fmt is not None or "response_format" in used, do_sample, columns.logprobs,
                   top if columns.top_logprobs else 0, g.seed is not None or "seed" in used, response_template,
                   history if history or used & set(CONTROL_SETTINGS) else None)
        return plan if plan.formats or plan.capture or plan.history is not None \
            or (plan.do_sample and (plan.seeds or own_draws)) else None

    def why(self) -> str:
        """What the job asks of the step control, in words (for messages that name it)."""
        asked = [what for what, on in (("a response format", self.formats), ("logprobs", self.capture),
                                       (f"top {self.top_logprobs} logprobs", self.top_logprobs > 0),
                                       ("history controls (penalties, min_p, bad words, min_tokens, the loop stop)",
                                        self.history is not None),
                                       ("seeded sampling", self.do_sample and self.seeds)) if on]
        return ", ".join(asked) or "cbgen's own draw of sampled tokens"

    def request_kwargs(self, record_id: str, settings: dict[str, Any], job_seed: int | None,
                       grammars: Grammars | None, max_new_tokens: int = 0
                       ) -> tuple[dict[str, Any], ResponseFormat | None]:
        """The processor kwargs of one request and the format it follows. Raises RowError when its format does not
        compile."""
        from cbgen.control.processor import GRAMMAR_KWARG, SEED_KWARG

        kwargs: dict[str, Any] = {}
        fmt = settings.get("response_format", self.job_format)
        if fmt is not None:
            if grammars is None:
                raise RowError("the row asks for a response_format, but the job compiles no grammars: give it the "
                               "format (--json-schema, --regex, ...) or put such a row among the first ones")
            try:
                grammars.grammar(fmt)
            except FormatError as e:
                raise RowError(str(e)) from None
            kwargs[GRAMMAR_KWARG] = fmt.key
        seed = settings.get("seed", job_seed)
        if seed is not None and self.do_sample:
            kwargs[SEED_KWARG] = request_seed(seed, record_id)
        if self.history is not None:
            controls = self.request_controls(settings, max_new_tokens)
            if controls is not None:
                from cbgen.control.penalties import CONTROLS_KWARG

                kwargs[CONTROLS_KWARG] = controls
        return kwargs, fmt

    def request_controls(self, settings: dict[str, Any], max_new_tokens: int) -> str | None:
        """The key of a request's history controls (the row's over the job's; a row's bad words add to the job's),
        or None when it has none. Raises RowError for a row's value that cannot apply to this model or request."""
        from cbgen.control.penalties import Controls

        own = {k: settings[k] for k in CONTROL_SETTINGS if k in settings}
        job = self.history or {}
        if not own and (not job.get("min_tokens") or job["min_tokens"] <= max_new_tokens):
            return self.job_key
        values = {**job, **own}
        if values.get("min_tokens") and values["min_tokens"] > max_new_tokens:
            raise RowError(f"min_tokens {values['min_tokens']} is more than the request's max_new_tokens "
                           f"{max_new_tokens}: lower it, or raise the cap")
        for name, ids in (("logit_bias", own.get("logit_bias") or {}),
                          ("bad_words", [t for w in own.get("bad_words", ()) if not isinstance(w, str) for t in w])):
            outside = [t for t in ids if int(t) >= self.vocab_size]
            if outside:
                raise RowError(f"{name} names token {outside[0]}, outside the model's vocabulary of {self.vocab_size}")
        if "bad_words" in own:
            values["bad_words"] = [*job.get("bad_words", ()), *own["bad_words"]]
        controls = Controls.of(values)
        return controls.key() if controls.active else None

    @functools.cached_property
    def job_key(self) -> str | None:
        """The key of the job's own history controls (a request without its own), made once."""
        from cbgen.control.penalties import Controls

        controls = Controls.of(self.history or {})
        return controls.key() if controls.active else None

    def make_grammars(self, tokenizer: Any) -> Grammars | None:
        """The job's grammar compiler for `tokenizer`, when some request follows a format."""
        if not self.formats:
            return None
        from cbgen.control.grammars import Grammars

        return Grammars(tokenizer, self.vocab_size, self.response_template)

    def control(self, tokenizer: Any, grammars: Grammars | None = None) -> StepControl:
        """The step control of one engine (`grammars`: the job's, when this process compiled them already)."""
        from cbgen.control.processor import StepControl

        return StepControl(vocab_size=self.vocab_size, grammars=grammars or self.make_grammars(tokenizer),
                           do_sample=self.do_sample, capture=self.capture, top_logprobs=self.top_logprobs,
                           eos=self.eos, tokenizer=tokenizer)


def job_controls(job: JobConfig, vocab_size: int) -> dict[str, Any]:
    """The job's own history controls (those set, by name), checked against the model's vocabulary."""
    from cbgen.control.penalties import NEUTRAL

    g = job.generation
    values = {name: getattr(g, name) for name in NEUTRAL if getattr(g, name) not in (None, NEUTRAL[name])}
    values.pop("loop_stop_span", None)
    if values.get("loop_stop"):
        values["loop_stop_span"] = g.loop_stop_span or NEUTRAL["loop_stop_span"]
    outside = [t for t in g.logit_bias if int(t) >= vocab_size]
    if outside:
        raise CbgenError(f"--logit-bias names token {outside[0]}, outside the model's vocabulary of {vocab_size}")
    return values


def request_seed(seed: int, record_id: str) -> int:
    """A request's own seed, from the job's or row's seed and its input id: the same for the same row wherever and
    whenever it runs."""
    digest = hashlib.blake2b(f"{seed}\x1f{record_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
