"""One ContinuousBatchingManager's life: built from a spec, warmed up, started, stopped, drained. The engine uses it
in a single process and on rank 0; tensor-parallel followers use it to serve the same manager as rank 0."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cbgen.engine.scope import EngineScope, ScopePlan

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedTokenizerBase
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    from transformers.generation.continuous_batching.requests import GenerationOutput
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from cbgen.control.needs import StepPlan
    from cbgen.control.processor import StepControl
    from cbgen.model.load import CausalLM


@dataclass(frozen=True)
class ManagerSpec:
    """Everything that builds a manager. A tensor-parallel follower receives rank 0's (in its JobPlan), so that both
    build the same one. A manager may change the configurations it is given: each one gets copies."""

    generation_config: GenerationConfig
    cb_config: ContinuousBatchingConfig
    workload_hints: WorkloadHints | None = None
    scope: ScopePlan = field(default_factory=ScopePlan)  # what cbgen installs for the engine (cbgen.engine.scope)
    control: StepPlan | None = None  # grammar masks, the model's own logprobs, seeded draws


@dataclass
class CacheFacts:
    """What a started manager's KV cache turned out to be."""

    page_size: int
    num_blocks: int | None
    prefix_sharing: bool  # block sharing is only ever allowed: the cache turns it off for sliding-window layers
    # "as used": the cache came from an anonymous mapping (cbgen.engine.kv_memory), "as used, returned when freed":
    # and the blocks the pool takes back free give their pages back
    resident: str = "all at start"
    resolved_config: dict[str, Any] = field(default_factory=dict)


def start_manager(model: CausalLM, spec: ManagerSpec, scope: EngineScope, control: StepControl | None = None
                  ) -> tuple[ContinuousBatchingManager, CacheFacts]:
    """A started manager, its cache built by a warm-up so that its real size is known before the first admission;
    inside `scope` (entered), which joins `control`'s logits processors and serves its cache (cbgen.engine.scope)."""
    manager = model.init_continuous_batching(generation_config=copy.deepcopy(spec.generation_config),
                                             continuous_batching_config=copy.deepcopy(spec.cb_config),
                                             workload_hints=copy.deepcopy(spec.workload_hints))
    with scope.building(manager, control) as built:
        manager.warmup()
    cache = getattr(manager.batch_processor, "cache", None)
    resolved = manager.continuous_batching_config
    facts = CacheFacts(
        page_size=resolved.page_size,
        num_blocks=getattr(cache, "num_blocks", None) or resolved.num_blocks,
        prefix_sharing=bool(getattr(cache, "use_prefix_sharing", resolved.allow_block_sharing)),
        resident="as used, returned when freed" if built.returns_freed else "as used" if built.lazy else "all at start",
        resolved_config={k: v for k, v in vars(resolved).items()
                         if isinstance(v, (int, float, str, bool, tuple, type(None)))},
    )
    manager.start()
    scope.release_caller_pool()  # the warm-up's OpenMP workers, idle from now on (cbgen.engine.openmp)
    return manager, facts


def prefix_matches(manager: ContinuousBatchingManager) -> dict[str, int]:
    """A dict the manager fills as it schedules: for each request id, the prompt tokens its KV cache served from
    blocks already computed (shared prefixes, an earlier turn's) instead of computing them. Counted where the
    scheduler asks the cache for a match (transformers' PagedAttentionCache.search_prefix_match, on this manager's
    own cache object, which goes with the manager); empty when the cache cannot share blocks."""
    matched: dict[str, int] = {}
    cache = getattr(manager.batch_processor, "cache", None)
    search = getattr(cache, "search_prefix_match", None)
    if cache is None or search is None or not getattr(cache, "use_prefix_sharing", False):
        return matched

    # held weakly: the counter is set on the cache itself, and a strong reference to its bound method would make a
    # cycle that keeps the whole cache alive after the manager stops until a collection (which may never come: the
    # next engine's scope freezes what is alive for the collector)
    method = weakref.WeakMethod(search)

    def counted(request_id: str, prompt_ids: list[int]) -> int:
        bound = method()
        found = bound(request_id, prompt_ids) if bound is not None else 0
        if found:
            matched[request_id] = found
        return found

    cache.search_prefix_match = counted
    return matched


def stop_manager(manager: ContinuousBatchingManager, *, hard: bool = False) -> Iterator[GenerationOutput]:
    """Stops and destroys `manager`, yielding the results it still holds. A hard stop fails what was running."""
    try:
        manager.stop(block=True, timeout=20 if hard else 30, hard_stop=hard)
        yield from drain(manager)
    finally:
        manager.destroy()


def drain(manager: ContinuousBatchingManager) -> Iterator[GenerationOutput]:
    """The results waiting in the manager's queue, without waiting for more."""
    while (result := manager.get_result(timeout=0)) is not None:
        yield result


def live_lengths(manager: ContinuousBatchingManager) -> list[int]:
    """The tokens generated so far by each sequence the manager is running, for the progress display: read from its
    scheduler (transformers' own structure, read without a lock from another thread, so a snapshot up to a step old);
    empty when it cannot be read."""
    try:
        active = manager.batch_processor.scheduler.active_requests  # type: ignore[union-attr]
        return [len(state.generated_tokens) for state in list(active.values())]
    except (AttributeError, RuntimeError):  # no batch processor yet; the dict changed while copied
        return []


def loop_error(manager: ContinuousBatchingManager) -> str:
    """Why a manager's generation loop stopped, as a message for the requests it took down."""
    fatal = getattr(manager.background_thread_status, "fatal_error", None)
    return f"the generation loop stopped: {fatal}" if fatal else "the generation loop stopped unexpectedly"


def serve(model: CausalLM, tokenizer: PreTrainedTokenizerBase, spec: ManagerSpec) -> None:
    """A tensor-parallel follower's part: run the manager rank 0 describes until rank 0 stops it, with the same step
    control (so every rank masks and draws alike). Every rank receives every result; the follower drops them."""
    control = spec.control.control(tokenizer) if spec.control is not None else None
    with EngineScope(model, spec.scope) as scope:
        manager, _ = start_manager(model, spec, scope, control)
        try:
            while manager.is_running():
                manager.get_result(timeout=0.5)
        finally:
            for _ in stop_manager(manager):
                pass
