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
                     projections (cbgen.model.fused: the merge itself is made once per model, and is the model's own)
    linear layers    a forward of cbgen's on each nn.Linear: fixed-shape tiles (cbgen.model.invariant), row buckets,
                     vocabulary chunks or prepacked oneDNN weights (cbgen.model.linear)
    KV cache         big zero tensors from anonymous mappings while the manager builds its cache (a torch function
                     mode of this thread), and freed blocks' pages handed back (the manager's pool)
    step control     cbgen's logits processors in the manager's list, and transformers' own draw left to them
                     (cbgen.control.processor)

and around them what a run changes in the process, each a `Change` of cbgen.engine.changes with one way to be made,
undone and checked: the model held by this scope, transformers' logging quietened, the older objects frozen for the
collector (gc.freeze), the caller's idle OpenMP pool freed while the engine waits (`release_caller_pool`), and in each
manager it builds the step control's processors, the KV cache's page hand-back and its `num_return_sequences`, set
for one request at a time (`forking`) and always put back. Logging and gc are shared by the scopes open at once: the
first makes the change, the last undoes it.

On entry the scope checks that what serves the model is what the plan asked for, and raises otherwise; one model is
held by one scope at a time (a second engine on a model that is generating is refused with a one-line error), while
two models in one process each run their own plan. On exit everything is put back, in reverse order, and `check()`
then finds each change undone. run.json records `ScopePlan.describe()`: what was installed, from the plan.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.engine.changes import GcFrozen, Quieted
from cbgen.engine.openmp import CallerPool
from cbgen.errors import CbgenError
from cbgen.process.changes import Attribute, Change, Undo

if TYPE_CHECKING:
    import torch

    from cbgen.control.processor import StepControl

COMPILED = "per-sequence, compiled kernel (batch-invariant by construction)"
PER_SEQUENCE = "per-sequence"
PER_SEQUENCE_INVARIANT = "per-sequence, batch-invariant"
STOCK = "stock"
SOFT_CAPPED = "stock, soft-capped"
PACKED_ROWS = "rows packed end to end, compiled kernel (batch-invariant by construction)"  # the scorer's
ATTENTION_KINDS = (COMPILED, PER_SEQUENCE, PER_SEQUENCE_INVARIANT, STOCK, SOFT_CAPPED, PACKED_ROWS)
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
    fused_ops: bool = False  # and their norms, rotary embedding and SiLU run cbgen's compiled operators
    kernel_why: str = "off"  # why the compiled attention kernel serves the model, or why not
    linear_kernel: tuple[bool, str] = (False, "off")  # whether the invariant linear layers run the compiled kernel, why
    # the attention implementation transformers runs the model with once its manager switched it (sdpa, paged|eager,
    # flash_attention_2, ...: cbgen.engine.setup.engine_attention); None: not planned (a scorer's scope)
    implementation: str | None = None

    def describe(self) -> dict[str, Any]:
        """What the scope installs, for run.json."""
        from cbgen.model.linear import LINEAR_KINDS

        return {"attention": self.attention, "implementation": self.implementation,
                "batch_invariant": {"on": self.batch_invariant, "why": self.invariant_why},
                "linear": LINEAR_KINDS[self.linear],
                "dense_attention_mask": "built" if self.dense_mask else
                "not built: cbgen's per-sequence attention does not read it" if self.attention in CPU_ATTENTION else
                f"not built: {self.implementation} attention does not read it",
                "kv_cache_memory": "as used, freed blocks given back" if self.lazy_kv_cache else "all at start",
                "decoder_layers": {"fused": self.fused_layers, "why": self.fused_why,
                                   "compiled_operators": self.fused_ops},
                "attention_kernel": {"compiled": self.attention == COMPILED, "why": self.kernel_why},
                "linear_kernel": {"compiled": self.linear_kernel[0], "why": self.linear_kernel[1]}}


@dataclass
class BuiltCache:
    """What building a manager's cache turned out to be (cbgen.engine.manager.CacheFacts reads it)."""

    lazy: bool = False  # the cache came from anonymous mappings
    returns_freed: bool = False  # and freed blocks give their pages back


_held_lock = threading.Lock()
_held: dict[int, tuple[str, object]] = {}  # id(model) -> the thread whose scope holds it, and that scope's token


class _Held(Change):
    """The model held by one scope (one model runs one engine at a time)."""

    what = "the model held by its engine"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.key, self.token = id(model), (threading.current_thread().name, object())

    def install(self) -> None:
        with _held_lock:
            holder = _held.get(self.key)
            if holder is not None:
                raise CbgenError(f"this model is already generating in another engine (thread {holder[0]!r}); one "
                                 "model runs one engine at a time: give each thread its own cbgen.Generator")
            _held[self.key] = self.token

    def remove(self) -> None:
        with _held_lock:
            if _held.get(self.key) is self.token:
                del _held[self.key]

    def problem(self) -> str | None:
        holds = _held.get(self.key) is self.token
        return None if holds == self.installed else "held after its scope ended" if holds else "not held"


def process_changes() -> list[Change]:
    """The process-wide changes every engine scope makes, in the order it makes them (cbgen.engine.changes)."""
    return [Quieted("transformers"), GcFrozen(), CallerPool()]


class EngineScope:
    """The plan's installs on `model`, from `__enter__` to `__exit__` (see the module)."""

    def __init__(self, model: torch.nn.Module, plan: ScopePlan) -> None:
        self.model = model
        self.plan = plan
        self._stack: ExitStack | None = None
        self.changes: list[Change] = []  # what the scope changed outside the model, checked by `check`
        self._pool: CallerPool | None = None
        self._forks: Attribute | None = None  # the manager's num_return_sequences, once a manager is built

    def __enter__(self) -> EngineScope:
        stack = ExitStack()
        self._stack, self.changes = stack, []
        try:
            self._enter(_Held(self.model))
            for change in process_changes():
                self._enter(change)
            self._install(stack)
            self.check()
        except BaseException:
            self._stack = None
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _enter(self, change: Change) -> Any:
        assert self._stack is not None
        self._stack.enter_context(change)
        self.changes.append(change)
        if isinstance(change, CallerPool):
            self._pool = change
        return change

    def release_caller_pool(self) -> bool:
        """Frees the calling thread's idle OpenMP pool, while the scope is open (cbgen.engine.openmp)."""
        return self._pool is not None and self._pool.release()

    def forking(self, n: int | None) -> AbstractContextManager[None]:
        """While the block runs, the manager forks each request it is given into `n` sequences (None: the job's
        number, as the manager was built with)."""
        if n is None:
            return nullcontext()
        if self._forks is None:
            raise RuntimeError("the manager's forks are set inside its EngineScope, once it is built")
        return self._forks.set(n)

    def _install(self, stack: ExitStack) -> None:
        plan, model = self.plan, self.model
        if plan.attention in CPU_ATTENTION:
            from cbgen.attention import per_sequence_attention

            stack.enter_context(per_sequence_attention(model, required=True,
                                                       invariant=plan.attention == PER_SEQUENCE_INVARIANT,
                                                       compiled=plan.attention == COMPILED))
        elif plan.attention == PACKED_ROWS:
            from cbgen.attention.packed import packed_rows_attention

            stack.enter_context(packed_rows_attention(model))
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

            ops = compiled_kernel("decoder_ops") if plan.fused_ops else None
            merged = stack.enter_context(fused_layers(model, ops))
        if plan.batch_invariant:
            from cbgen.model.invariant import batch_invariant_linear
            from cbgen.model.tiles_kernel import KERNEL

            stack.enter_context(batch_invariant_linear(model, merged, compiled_kernel(KERNEL)
                                                       if plan.linear_kernel[0] else None))
        else:
            from cbgen.model.linear import linear_layers

            stack.enter_context(linear_layers(model, plan.linear, merged))

    def check(self) -> None:
        """Raises RuntimeError unless everything is as the scope should have it: while it is open, what serves the
        model is what the plan asked for and each of its changes is in effect; once it is closed, each change was
        undone and no attention function of cbgen's is bound for the model."""
        if self._stack is not None:
            self._check_plan()
        else:
            from cbgen.attention.registry import bound_function
            from cbgen.attention.softcap import PAGED_EAGER

            if bound_function(self.model, "sdpa") or bound_function(self.model, PAGED_EAGER):
                raise RuntimeError("the engine scope is closed, and an attention function of cbgen's is still bound")
        problems = [f"{change.what}: {problem}" for change in self.changes if (problem := change.problem())]
        if problems:
            raise RuntimeError(f"the engine scope's changes are not as they should be: {'; '.join(problems)}")

    def _check_plan(self) -> None:
        from cbgen.attention import batch_invariant_sdpa_forward, compiled_sdpa_forward, per_sequence_sdpa_forward
        from cbgen.attention.dense_mask import built_for
        from cbgen.attention.packed import packed_rows_forward
        from cbgen.attention.registry import bound_function, serving
        from cbgen.attention.softcap import PAGED_EAGER, capped_paged_eager_forward

        plan, model = self.plan, self.model
        functions: dict[str, tuple[str, Callable[..., Any]]] = {
            COMPILED: ("sdpa", compiled_sdpa_forward),
            PER_SEQUENCE: ("sdpa", per_sequence_sdpa_forward),
            PER_SEQUENCE_INVARIANT: ("sdpa", batch_invariant_sdpa_forward),
            SOFT_CAPPED: (PAGED_EAGER, capped_paged_eager_forward),
            PACKED_ROWS: ("sdpa", packed_rows_forward)}
        wanted = functions.get(plan.attention)
        if wanted is not None and not serving(model, wanted[0], wanted[1]):
            raise RuntimeError(f"the plan's {plan.attention} attention does not serve the model: something replaced "
                               f"transformers' {wanted[0]!r} attention after cbgen bound its own")
        if wanted is None and (bound_function(model, "sdpa") or bound_function(model, PAGED_EAGER)):
            raise RuntimeError("the plan asked for the stock attention, and a function of cbgen's is bound")
        config = model.config
        if getattr(config, "_attn_implementation", None) == "sdpa" and plan.implementation in (None, "sdpa") \
                and built_for(config) != plan.dense_mask:
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
        undo: list[Undo] = []
        if control is not None:
            from cbgen.control.processor import install

            undo.append(Undo("the step control's processors in the manager", install(manager, control)))
        from cbgen.engine.kv_memory import lazy_cache_memory

        built = BuiltCache()
        with lazy_cache_memory(self.plan.lazy_kv_cache) as lazy:
            yield built
        self._check_built(manager)
        if control is not None:
            from cbgen.control.processor import take_over_sampling

            if (taken := take_over_sampling(manager, control)) is not None:
                undo.append(Undo("the manager's draw left to the step control", taken))
        returned = lazy.return_freed_blocks(getattr(manager.batch_processor, "cache", None)) if lazy else None
        if returned is not None:
            undo.append(Undo("freed blocks' pages given back", returned))
        built.lazy, built.returns_freed = bool(lazy), returned is not None
        for change in undo:
            self._enter(change)
        self._forks = self._enter(Attribute(manager, "num_return_sequences"))

    def _check_built(self, manager: Any) -> None:
        running = getattr(self.model.config, "_attn_implementation", None)
        if self.plan.implementation is not None and running != self.plan.implementation:
            raise RuntimeError(f"the manager runs the model with {running} attention, and the plan was made for "
                               f"{self.plan.implementation}")
        resolved = manager.continuous_batching_config
        compiled = any(getattr(resolved, name, None) is not None
                       for name in ("varlen_compile_config", "decode_compile_config"))
        if compiled and not self.plan.dense_mask and self.plan.attention in CPU_ATTENTION:
            raise RuntimeError("transformers compiled the forward pass, which needs its dense attention mask, and the "
                               "plan skipped it")
        io = getattr(manager.batch_processor, "inputs_and_outputs", None)
        mask = getattr(io, "attention_mask", False)  # False: an IO class without one to look at
        if mask is not False and (mask is not None) != self.plan.dense_mask:
            raise RuntimeError(f"the manager was built {'with' if mask is not None else 'without'} the dense attention "
                               f"mask, and the plan {'builds' if self.plan.dense_mask else 'skips'} it")


def compiled_kernel(name: str) -> Any:
    """cbgen's compiled operators (torch.ops.cbgen_kernels) with the kernel `name` loaded in this process: a replica
    process planned by its parent has not loaded them yet."""
    import torch

    from cbgen.kernels import kernel

    built = kernel(name)
    if not built.loaded:
        raise RuntimeError(f"cbgen's compiled kernel {name} is not available: {built.detail}")
    return torch.ops.cbgen_kernels
