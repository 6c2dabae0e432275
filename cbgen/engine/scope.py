"""Everything cbgen installs into transformers and torch for one engine, entered and left as one scope.

A job's plan decides how its engine computes (`ScopePlan`, made by cbgen.engine.setup): which attention function
serves the model, whether the numerics are batch-invariant, how its linear layers run, whether transformers builds
its dense attention mask, and whether the KV cache takes memory as it is used. `EngineScope` carries that out around
the engine's whole life, and nothing of it outlives the scope:

    attention        cbgen's function bound for this model in transformers' attention registry (its compiled kernel,
                     cbgen.attention.compiled, or its eager per-sequence path)
                     (cbgen.attention.registry: a dispatcher routes each call by its model), with the per-pass
                     memo's forward hooks (cbgen.attention.pass_memo); or the soft-capped paged eager function
    dense mask       transformers told this model's manager needs no dense mask (cbgen.attention.dense_mask)
    decoder layers   a fused forward of cbgen's on each decoder layer of the architectures it knows, over merged
                     projections (cbgen.model.fused)
    linear layers    a forward of cbgen's on each nn.Linear: fixed-shape tiles (cbgen.model.invariant), row buckets,
                     vocabulary chunks or prepacked oneDNN weights (cbgen.model.linear)
    KV cache         big zero tensors from anonymous mappings while the manager builds its cache (a torch function
                     mode of this thread), and freed blocks' pages handed back (the manager's pool)
    step control     cbgen's logits processors in the manager's list, and transformers' own draw left to them
                     (cbgen.control.processor)

On entry the scope checks that what serves the model is what the plan asked for, and raises otherwise; one model is
held by one scope at a time (a second engine on a model that is generating is refused with a one-line error), while
two models in one process each run their own plan. On exit everything is put back, in reverse order. run.json records
`ScopePlan.describe()`: what was installed, from the plan.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.errors import CbgenError

if TYPE_CHECKING:
    import torch

    from cbgen.control.processor import StepControl

COMPILED = "per-sequence, compiled kernel (batch-invariant by construction)"
PER_SEQUENCE = "per-sequence"
PER_SEQUENCE_INVARIANT = "per-sequence, batch-invariant"
STOCK = "stock"
SOFT_CAPPED = "stock, soft-capped"
ATTENTION_KINDS = (COMPILED, PER_SEQUENCE, PER_SEQUENCE_INVARIANT, STOCK, SOFT_CAPPED)
CPU_ATTENTION = (COMPILED, PER_SEQUENCE, PER_SEQUENCE_INVARIANT)  # cbgen's own: no dense mask, its CPU batch limits


@dataclass(frozen=True)
class ScopePlan:
    """How an engine computes, decided in planning; `EngineScope` installs it."""

    attention: str = STOCK  # one of ATTENTION_KINDS
    batch_invariant: bool = False
    invariant_why: str = "off"
    linear: str = "stock"  # a key of cbgen.model.linear.LINEAR_KINDS
    dense_mask: bool = True  # transformers builds its dense sdpa mask (False: cbgen's per-sequence attention skips it)
    lazy_kv_cache: bool = False  # CPU: the KV cache takes RAM as pages are written, and gives back freed blocks'
    fused_layers: bool = False  # the decoder layers run cbgen's fused forward (cbgen.model.fused)
    fused_why: str = "off"
    kernel_why: str = "off"  # why the compiled attention kernel serves the model, or why not

    def describe(self) -> dict[str, Any]:
        """What the scope installs, for run.json."""
        from cbgen.model.linear import LINEAR_KINDS

        return {"attention": self.attention, "batch_invariant": {"on": self.batch_invariant, "why": self.invariant_why},
                "linear": LINEAR_KINDS[self.linear],
                "dense_attention_mask": "built" if self.dense_mask
                else "not built: cbgen's per-sequence attention does not read it",
                "kv_cache_memory": "as used, freed blocks given back" if self.lazy_kv_cache else "all at start",
                "decoder_layers": {"fused": self.fused_layers, "why": self.fused_why},
                "attention_kernel": {"compiled": self.attention == COMPILED, "why": self.kernel_why}}


@dataclass
class BuiltCache:
    """What building a manager's cache turned out to be (cbgen.engine.manager.CacheFacts reads it)."""

    lazy: bool = False  # the cache came from anonymous mappings
    returns_freed: bool = False  # and freed blocks give their pages back


_held_lock = threading.Lock()
_held: dict[int, str] = {}  # id(model) -> the thread whose scope holds it


class EngineScope:
    """The plan's installs on `model`, from `__enter__` to `__exit__` (see the module)."""

    def __init__(self, model: torch.nn.Module, plan: ScopePlan) -> None:
        self.model = model
        self.plan = plan
        self._stack: ExitStack | None = None

    def __enter__(self) -> EngineScope:
        stack = ExitStack()
        try:
            self._hold(stack)
            self._install(stack)
            self.check()
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _hold(self, stack: ExitStack) -> None:
        key = id(self.model)
        with _held_lock:
            holder = _held.get(key)
            if holder is not None:
                raise CbgenError(f"this model is already generating in another engine (thread {holder!r}); one "
                                 "model runs one engine at a time: give each thread its own cbgen.Generator")
            _held[key] = threading.current_thread().name

        def release() -> None:
            with _held_lock:
                _held.pop(key, None)

        stack.callback(release)

    def _install(self, stack: ExitStack) -> None:
        plan, model = self.plan, self.model
        if plan.attention in CPU_ATTENTION:
            from cbgen.attention import per_sequence_attention

            stack.enter_context(per_sequence_attention(model, required=True,
                                                       invariant=plan.attention == PER_SEQUENCE_INVARIANT,
                                                       compiled=plan.attention == COMPILED))
        elif plan.attention == SOFT_CAPPED:
            from cbgen.attention.softcap import softcapped_paged_eager

            if not stack.enter_context(softcapped_paged_eager(model)):
                raise RuntimeError("the plan asked for soft-capped paged eager attention, and the model needs none")
        if not plan.dense_mask:
            from cbgen.attention.dense_mask import skipped

            stack.enter_context(skipped(model))
        merged = None
        if plan.fused_layers:
            from cbgen.model.fused import fused_layers

            merged = stack.enter_context(fused_layers(model))
        if plan.batch_invariant:
            from cbgen.model.invariant import batch_invariant_linear

            stack.enter_context(batch_invariant_linear(model, merged))
        else:
            from cbgen.model.linear import linear_layers

            stack.enter_context(linear_layers(model, plan.linear, merged))

    def check(self) -> None:
        """Raises RuntimeError unless what serves the model is what the plan asked for."""
        from cbgen.attention import batch_invariant_sdpa_forward, compiled_sdpa_forward, per_sequence_sdpa_forward
        from cbgen.attention.dense_mask import built_for
        from cbgen.attention.registry import bound_function, serving
        from cbgen.attention.softcap import PAGED_EAGER, capped_paged_eager_forward

        plan, model = self.plan, self.model
        functions: dict[str, tuple[str, Callable[..., Any]]] = {
            COMPILED: ("sdpa", compiled_sdpa_forward),
            PER_SEQUENCE: ("sdpa", per_sequence_sdpa_forward),
            PER_SEQUENCE_INVARIANT: ("sdpa", batch_invariant_sdpa_forward),
            SOFT_CAPPED: (PAGED_EAGER, capped_paged_eager_forward)}
        wanted = functions.get(plan.attention)
        if wanted is not None and not serving(model, wanted[0], wanted[1]):
            raise RuntimeError(f"the plan's {plan.attention} attention does not serve the model: something replaced "
                               f"transformers' {wanted[0]!r} attention after cbgen bound its own")
        if wanted is None and (bound_function(model, "sdpa") or bound_function(model, PAGED_EAGER)):
            raise RuntimeError("the plan asked for the stock attention, and a function of cbgen's is bound")
        config = model.config
        if getattr(config, "_attn_implementation", None) == "sdpa" and built_for(config) != plan.dense_mask:
            raise RuntimeError(f"the plan {'builds' if plan.dense_mask else 'skips'} transformers' dense attention "
                               "mask, and transformers would not")

    @contextmanager
    def building(self, manager: Any, control: StepControl | None = None) -> Iterator[BuiltCache]:
        """Around a manager's warm-up (where transformers builds its batch processor and cache): the step control's
        processors joined before, big zero tensors served lazily during, and after it the sampler handed to the
        control and freed blocks' pages given back. What is changed inside the manager is undone on the scope's exit
        (a destroyed manager takes it with it anyway)."""
        if self._stack is None:
            raise RuntimeError("a manager is built inside an entered EngineScope")
        undo: list[Callable[[], None] | None] = []
        if control is not None:
            from cbgen.control.processor import install

            undo.append(install(manager, control))
        from cbgen.engine.kv_memory import lazy_cache_memory

        built = BuiltCache()
        with lazy_cache_memory(self.plan.lazy_kv_cache) as lazy:
            yield built
        self._check_built(manager)
        if control is not None:
            from cbgen.control.processor import take_over_sampling

            undo.append(take_over_sampling(manager, control))
        returned = lazy.return_freed_blocks(getattr(manager.batch_processor, "cache", None)) if lazy else None
        undo.append(returned)
        built.lazy, built.returns_freed = bool(lazy), returned is not None
        for step in reversed(undo):
            if step is not None:
                self._stack.callback(step)

    def _check_built(self, manager: Any) -> None:
        resolved = manager.continuous_batching_config
        compiled = any(getattr(resolved, name, None) is not None
                       for name in ("varlen_compile_config", "decode_compile_config"))
        if compiled and not self.plan.dense_mask:
            raise RuntimeError("transformers compiled the forward pass, which needs its dense attention mask, and the "
                               "plan skipped it")
        io = getattr(manager.batch_processor, "inputs_and_outputs", None)
        mask = getattr(io, "attention_mask", False)  # False: an IO class without one to look at
        if mask is not False and (mask is not None) != self.plan.dense_mask:
            raise RuntimeError(f"the manager was built {'with' if mask is not None else 'without'} the dense attention "
                               f"mask, and the plan {'builds' if self.plan.dense_mask else 'skips'} it")
