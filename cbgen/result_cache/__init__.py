"""The result cache: answers kept across runs, so the same sequence is never computed twice (docs/cache.md).

    keys.py    what decides an answer (its key) and the numerics it was computed with
    store.py   one file per entry, atomic renames, least recently used out first
    cache.py   a job's side: answer the requests it holds, keep what the engine computes

On by default for `cbgen run`, `cbgen score`, pipelines and the Python API (`--no-cache` turns it off,
`CBGEN_RESULT_CACHE=off` too unless `--cache DIR` names one), in `--cache DIR` or `$CBGEN_CACHE_DIR/results`
(`~/.cache/cbgen/results`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.errors import CbgenError

if TYPE_CHECKING:
    from cbgen.config import JobConfig
    from cbgen.engine.job_plan import JobPlan
    from cbgen.engine.scope import ScopePlan
    from cbgen.model.load import LoadedModel
    from cbgen.records import Completion
    from cbgen.result_cache.cache import ResultCache

    Groups = list[Completion]

ENV = "CBGEN_RESULT_CACHE"  # "off": no result cache unless a job names its directory (test suites, benchmarks)
GB = 1_000_000_000


def default_cache_dir(chosen: str | None = None) -> Path:
    """--cache DIR, else $CBGEN_CACHE_DIR/results, else $XDG_CACHE_HOME/cbgen/results (~/.cache/cbgen/results)."""
    if chosen:
        return Path(chosen).expanduser()
    from cbgen.cache_root import default_cache_dir as models

    return models() / "results"


def parse_size(text: str, where: str) -> int:
    """'4GB', '500MB', '1.5G', '2e9' (bytes) -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)b?\s*", text.lower())
    if not match:
        raise CbgenError(f"{where} {text!r}: give a size such as 4GB, 500MB or 2e9 (bytes)")
    factor = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2)]
    return int(float(match.group(1)) * factor)


def enabled(job: JobConfig) -> bool:
    if not job.run.result_cache:
        return False
    return job.run.cache is not None or os.environ.get(ENV, "").lower() != "off"


def report(cache: ResultCache | None, job: JobConfig) -> dict[str, Any]:
    """What run.json says of the result cache in a run: its counts, or why it was off."""
    return cache.report() if cache is not None else off(job)


def off(job: JobConfig) -> dict[str, Any]:
    """What run.json says when a run used no result cache, and why."""
    if not job.run.result_cache:
        why = "--no-cache (run.result_cache: false)"
    elif not enabled(job):
        why = f"{ENV}=off"
    else:
        why = "the model's weights cannot be named by their content (not on disk)"
    return {"on": False, "why": why}


def for_generation(job: JobConfig, loaded: LoadedModel, plan: JobPlan) -> ResultCache | None:
    """A generating job's result cache, or None when it is off or the model's weights cannot be named by content."""
    return _open(job, loaded, plan.engine.scope, eos=plan.engine.eos_token_ids,
                 sampling=plan.sampling.generation_fields(), capture=job.generation.logprobs)


def for_scoring(job: JobConfig, loaded: LoadedModel, scope: ScopePlan) -> ResultCache | None:
    """A scoring job's result cache (exact hits only from batch-invariant scoring: each row alone), or None."""
    return _open(job, loaded, scope, eos=frozenset(), sampling={}, capture=job.generation.logprobs,
                 top_logprobs=job.generation.top_logprobs or 0)


def adapter_identities(job: JobConfig, memo: Path) -> dict[str | None, dict[str, Any]]:
    """Each name a request may give its adapter by (None: the job's own) -> that adapter's identity by content."""
    from cbgen.model.adapters import job_adapters

    adapters = job_adapters(job)
    if adapters is None:
        return {}
    found: dict[str | None, dict[str, Any]] = {a.name: a.identity(memo) for a in adapters.all}
    if adapters.default is not None:
        found[None] = found[adapters.default.name]
    return found


def _open(job: JobConfig, loaded: LoadedModel, scope: ScopePlan, *, eos: frozenset[int], sampling: dict[str, Any],
          capture: bool, top_logprobs: int = 0) -> ResultCache | None:
    if not enabled(job):
        return None
    from cbgen.model import dtype_name
    from cbgen.result_cache.cache import ResultCache
    from cbgen.result_cache.keys import Keyer, Numerics, weights_identity
    from cbgen.result_cache.store import ResultStore

    store = ResultStore(default_cache_dir(job.run.cache))
    model = weights_identity(loaded, store.root / "digests.json")
    if model is None:
        return None
    keyer = Keyer(model, dtype_name(loaded.dtype), sorted(eos), dict(sampling), bool(sampling.get("do_sample")),
                  adapter_identities(job, store.root / "digests.json"))
    return ResultCache(store, keyer, Numerics.of(loaded, scope, job.model.tp_size), near=job.run.cache_near_hits,
                       max_bytes=int(job.run.cache_max_size * GB),
                       num_return_sequences=job.generation.num_return_sequences,
                       max_new_tokens=job.generation.max_new_tokens, capture=capture, top_logprobs=top_logprobs)


def through(cache: ResultCache | None, requests: Iterator[Any], compute: Callable[[Iterator[Any]], Iterator[Groups]],
            *, scores: bool = False) -> Iterator[Groups]:
    """`compute` run on `requests` (Requests, or ScoreRequests with `scores`) with the cache around it: requests it
    answers pass through `compute` marked `answered` (the engine and the scorer yield them as they are), and each
    computed result is kept on its way out; the cache is kept within its size at the end."""
    if cache is None:
        return compute(requests)
    answer = cache.answer_score if scores else cache.answer
    # None passes through: a source's "nothing now" (cbgen.engine.engine.Engine.run)
    return cache.kept(compute(r if r is None else answer(r) for r in requests), scores=scores)
