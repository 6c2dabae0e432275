"""Setting the engine up for a job: one path for `cbgen run` and `cbgen bench`, so what is measured is what runs.

From the job's configuration, the loaded model and what the requests read ahead ask for, this decides the
GenerationConfig, what cbgen installs for the engine (the attention, batch invariance, how linear layers run, the
dense mask and the KV cache's memory: a ScopePlan, cbgen.engine.scope), the CPU batching defaults, the KV-cache size,
the ContinuousBatchingConfig and the workload hints, and records why. Every consumer reads these decisions from the
plan; none works them out again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil
from typing import TYPE_CHECKING, Any

from cbgen.config import JobConfig
from cbgen.config.cpu import cpu_row
from cbgen.control.sampling import SamplingPlan
from cbgen.engine.engine import EngineSettings
from cbgen.engine.kv_sizing import WorkloadShape, sharing_choice, size_kv_cache
from cbgen.engine.manager import ManagerSpec
from cbgen.engine.scope import (
    COMPILED,
    CPU_ATTENTION,
    PACKED_ROWS,
    PER_SEQUENCE_INVARIANT,
    SOFT_CAPPED,
    STOCK,
    ScopePlan,
)
from cbgen.engine.scope import PER_SEQUENCE as PER_SEQUENCE_ATTENTION
from cbgen.engine.transformers_choices import engine_attention, mask_needed, max_requests_per_batch, synchronous_loop
from cbgen.errors import CbgenError
from cbgen.model import dtype_name
from cbgen.model.adapters import job_adapters
from cbgen.model.load import PER_SEQUENCE, LoadedModel

if TYPE_CHECKING:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from cbgen.control.needs import StepPlan

# KV page size on CPU for requests that continue each other (a chat stage's turns): only whole pages are shared, so
# small pages serve more of each turn's prompt from the cache, the same tokens (figures: docs/performance.md, 'Why
# the constants are what they are')
CONTINUED_PAGE_SIZE = 32


@dataclass(frozen=True)
class EnginePlan:
    """How the engine runs: the GenerationConfig, the ContinuousBatchingConfig fields (the user's and cbgen's
    choices), how the KV cache was sized, and the settings the Engine (and its manager) is built from."""

    generation_config: GenerationConfig
    eos_token_ids: frozenset[int]
    batching: dict[str, Any]
    kv_cache: dict[str, Any]  # how the KV cache was sized, for run.json
    settings: EngineSettings

    @property
    def scope(self) -> ScopePlan:
        """What cbgen installs for the engine (cbgen.engine.scope)."""
        return self.settings.spec.scope


def plan_engine(job: JobConfig, loaded: LoadedModel, workload: WorkloadShape, sampling: SamplingPlan,
                steps: StepPlan | None = None, replicas: int = 1) -> EnginePlan:
    """The engine set-up for `job` on `loaded`: `sampling` is the per-request sampler plan; `steps` the step
    control, when the job needs one."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    text_config = loaded.model.config.get_text_config()
    max_positions = getattr(text_config, "max_position_embeddings", None)
    generation_config, eos = build_generation_config(job, loaded, sampling)
    batching = dict(job.batching)
    attention, kernel_why = attention_choice(job, loaded)
    if loaded.device == "cpu":
        for key, value in cpu_row().batching(attention in CPU_ATTENTION).items():
            batching.setdefault(key, value)
        if workload.continued:  # a conversation's next turn finds all of the turn before but its last partial page
            batching.setdefault("page_size", CONTINUED_PAGE_SIZE)
    window = job.run.max_in_flight or 2 * batching.get("max_requests_per_batch", max_requests_per_batch())
    window = ceil(window / replicas)  # per engine process: its share of the in-flight window (and of the cache)
    kv_cache = size_kv_cache(batching, loaded, workload, window, max_positions)
    kv_cache["block_sharing"] = sharing_choice(batching, loaded, workload)
    if steps is not None:
        synchronous_loop(batching, steps)
    cb_config = make_cb_config(batching, job, per_request=sampling.per_request)
    scope = plan_scope(job, loaded, attention, compiled=_compiled(cb_config, generation_config), kernel_why=kernel_why,
                       implementation=engine_attention(loaded.model, cb_config.auto_switch_to_flash))
    hints = WorkloadHints(max_prompt_length=workload.longest_prompt, max_generated_length=workload.max_new_tokens,
                          num_requests=(workload.requests or window) * workload.num_return_sequences)
    g = job.generation
    if steps is not None:
        steps = replace(steps, eos=tuple(sorted(eos)))
    settings = EngineSettings(
        spec=ManagerSpec(generation_config, cb_config, hints, scope, steps),
        max_in_flight=window,
        max_new_tokens=g.max_new_tokens, num_return_sequences=g.num_return_sequences, eos_token_ids=eos,
        max_positions=max_positions, request_timeout=job.run.request_timeout, prefix_gating=job.run.prefix_gating,
        adapters=job_adapters(job))
    return EnginePlan(generation_config, eos, batching, kv_cache, settings)


def build_generation_config(job: JobConfig, loaded: LoadedModel, plan: SamplingPlan
                            ) -> tuple[GenerationConfig, frozenset[int]]:
    """The GenerationConfig for the job, and its end-of-sequence ids. Starts from transformers' defaults, not the
    model's generation_config: a job's sampling is exactly what its configuration (and its rows, see
    cbgen.control.sampling) says. End-of-sequence tokens come from the model and tokenizer, plus --stop-token-id."""
    from transformers import GenerationConfig

    g = job.generation
    eos = set(g.stop_token_ids)
    for source in (getattr(loaded.model, "generation_config", None), loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        eos.update([value] if isinstance(value, int) else (value or []))
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    config = GenerationConfig(
        max_new_tokens=g.max_new_tokens,
        num_return_sequences=g.num_return_sequences,
        eos_token_id=sorted(eos) if eos else None,
        pad_token_id=pad if pad is not None else (min(eos) if eos else None),
        **plan.generation_fields(),
    )
    return config, frozenset(eos)


def attention_choice(job: JobConfig, loaded: LoadedModel) -> tuple[str, str]:
    """The attention the engine runs with (cbgen.engine.scope.ATTENTION_KINDS, before batch invariance), and why the
    compiled kernel does or does not serve it: cbgen's per-sequence attention by default on CPU where it applies,
    and when asked for by name (then it must apply), as the compiled kernel where it builds and fits the model
    (asked for with --compiled-attention, it must); transformers' paged eager attention with the soft-cap applied for
    models that soft-cap their scores; else stock."""
    from cbgen.attention import cpu_attention_unavailable_reason
    from cbgen.attention.softcap import softcap_fix_needed

    named = job.model.attn_implementation
    reason = cpu_attention_unavailable_reason(loaded.model)
    if named == PER_SEQUENCE and reason:
        raise CbgenError(f"--attn-implementation {PER_SEQUENCE} does not apply here: {reason}; use sdpa")
    if (named == PER_SEQUENCE or named is None and loaded.device == "cpu") and reason is None:
        return kernel_choice(job, loaded)
    why = f"off: cbgen's CPU attention does not serve this job ({reason or f'--attn-implementation {named}'})" \
        if loaded.device == "cpu" else f"off: the kernel is for CPU, and this job runs on {loaded.device}"
    if job.model.compiled_attention:
        raise CbgenError(f"--compiled-attention does not apply here: {why.removeprefix('off: ')}; drop the flag")
    return (SOFT_CAPPED if softcap_fix_needed(loaded.model) else STOCK), why


def kernel_choice(job: JobConfig, loaded: LoadedModel) -> tuple[str, str]:
    """cbgen's compiled attention where it builds and fits the model (cbgen.attention.compiled), else its eager
    per-sequence attention; and why. Asked for (--compiled-attention), it must apply."""
    from cbgen.attention import compiled_attention_unavailable_reason

    asked = job.model.compiled_attention
    if asked is False:
        return PER_SEQUENCE_ATTENTION, "off (--no-compiled-attention)"
    if job.model.tp_size > 1:
        reason: str | None = "tensor parallelism runs the stock linear layers' sums across ranks"
    else:
        reason = compiled_attention_unavailable_reason(loaded.model)
    if reason is not None:
        if asked:
            raise CbgenError(f"--compiled-attention does not apply here: {reason}; drop the flag")
        return PER_SEQUENCE_ATTENTION, f"off: {reason}"
    from cbgen.kernels import kernel

    built = kernel("paged_attention").detail
    return COMPILED, f"on ({built}; --no-compiled-attention turns it off)"


def invariance_choice(job: JobConfig, loaded: LoadedModel, attention: str) -> tuple[bool, str]:
    """Whether the job runs batch-invariant (cbgen.model.invariant, cbgen.attention.invariant), and why. Asked for
    (--batch-invariant), it must apply; by default it is on for seeded jobs where it applies."""
    asked = job.model.batch_invariant
    if asked is False:
        return False, "off (--no-batch-invariant)"
    reason = None
    if job.model.tp_size > 1:
        reason = "tensor parallelism splits each sum across ranks"
    elif attention not in CPU_ATTENTION:
        from cbgen.attention import cpu_attention_unavailable_reason

        named = job.model.attn_implementation
        if loaded.device != "cpu" or named:
            runs = f"on {loaded.device}" if loaded.device != "cpu" else f"--attn-implementation {named}"
            reason = f"it needs cbgen's per-sequence CPU attention, and this job runs {runs}"
        else:
            reason = ("it needs cbgen's per-sequence CPU attention, which does not apply: "
                      f"{cpu_attention_unavailable_reason(loaded.model)}")
    chosen = _linear_asked(job)
    if reason is None and chosen is not None:
        reason = f"{chosen} runs the linear layers its own way, and invariance runs them in fixed tiles"
    if reason is not None:
        if asked:
            raise CbgenError(f"--batch-invariant does not apply here: {reason}; drop the flag")
        return False, f"off: {reason}"
    if asked:
        return True, "on (--batch-invariant)"
    if attention == COMPILED:
        return True, ("on: cbgen's compiled attention is invariant by construction, the linear layers run in fixed "
                      "blocks (--no-batch-invariant turns it off)")
    if job.generation.seed is not None:
        return True, "on: a seeded job (--no-batch-invariant turns it off)"
    return False, "off: not a seeded job (--batch-invariant turns it on)"


def _linear_asked(job: JobConfig) -> str | None:
    """The flag that asks for a kind of linear layers of its own, if any."""
    if job.model.onednn_linear:
        return "--onednn-linear"
    return "--linear-row-buckets" if job.model.linear_row_buckets else None


def linear_choice(job: JobConfig, loaded: LoadedModel, invariant: bool) -> str:
    """How the model's linear layers run (cbgen.model.linear.LINEAR_KINDS): fixed-shape tiles for a batch-invariant
    job; through oneDNN or in row buckets when asked (each must apply); by default on CPU in one process, float32
    vocabulary projections in column chunks where this machine computes them bitwise alike, and bfloat16 or float16
    layers in row buckets."""
    from cbgen.model import linear

    settings, device, dtype = job.model, loaded.device, loaded.dtype
    one_process = job.model.tp_size == 1
    if invariant:
        return linear.TILES
    if settings.onednn_linear:
        refusal = linear.onednn_refusal(device, dtype, settings.tp_size)
        if refusal is not None:
            raise CbgenError(refusal)
        return linear.ONEDNN
    if settings.linear_row_buckets:
        if device != "cpu" or dtype not in linear.BUCKETED_DTYPES or not one_process:
            raise CbgenError("--linear-row-buckets applies to bfloat16 or float16 on CPU in one process: add --device "
                             "cpu --dtype bfloat16, without --tp")
        return linear.ROW_BUCKETS
    if device != "cpu" or not one_process:
        return linear.STOCK
    if dtype in linear.BUCKETED_DTYPES and settings.linear_row_buckets is None:
        return linear.ROW_BUCKETS
    if dtype_name(dtype) == "float32" and linear.vocabulary_chunks_apply(loaded.model):
        return linear.VOCABULARY_CHUNKS
    return linear.STOCK


def linear_kernel_choice(job: JobConfig, loaded: LoadedModel, invariant: bool) -> tuple[bool, str]:
    """Whether a batch-invariant job's linear layers run cbgen's compiled kernel (cbgen.model.tiles_kernel) rather
    than cbgen.model.invariant's fixed tiles, and why: by default wherever it builds and fits the model's dtype;
    asked for (--compiled-linear), it must apply."""
    from cbgen.kernels import kernel
    from cbgen.model.tiles_kernel import KERNEL, unfit_reason

    asked = job.model.compiled_linear
    if asked is False:
        return False, "off (--no-compiled-linear)"
    reason = "the job is not batch-invariant" if not invariant else \
        f"it runs on {loaded.device}" if loaded.device != "cpu" else unfit_reason(loaded.dtype)
    if reason is None:
        built = kernel(KERNEL)
        if built.loaded:
            return True, f"on ({built.detail}; --no-compiled-linear: the fixed tiles)"
        reason = built.detail
    if asked:
        raise CbgenError(f"--compiled-linear does not apply here: {reason}; drop the flag")
    return False, f"off: {reason}"


def fused_choice(job: JobConfig, loaded: LoadedModel) -> tuple[bool, str, bool]:
    """Whether the decoder layers run cbgen's fused forward (cbgen.model.fused), and why: by default on CPU in one
    process where the model fits it; asked for (--fused-layers), it must apply. And whether their norms, rotary
    embedding and SiLU run as cbgen's compiled operators: wherever those build and fit the model."""
    from cbgen.engine.scope import compiled_kernel
    from cbgen.kernels import kernel
    from cbgen.model.fused import unfit_reason
    from cbgen.model.fused_ops import ops_unfit_reason, probe_ops

    asked = job.model.fused_layers
    if asked is False:
        return False, "off (--no-fused-layers)", False
    if loaded.device != "cpu" or job.model.tp_size > 1:
        runs = "with --tp" if job.model.tp_size > 1 else f"on {loaded.device}"
        reason: str | None = f"written for CPU in one process, and this job runs {runs}"
    else:
        reason = unfit_reason(loaded.model)
    if reason is not None:
        if asked:
            raise CbgenError(f"--fused-layers does not apply here: {reason}; drop the flag")
        return False, f"off: {reason}", False
    why = "on (--fused-layers)" if asked else "on: the model's layers fit it (--no-fused-layers turns it off)"
    if job.model.compiled_ops is False:
        return True, why + "; norms, rotary and SiLU eager (--no-compiled-ops)", False
    unfit_ops = ops_unfit_reason(loaded.model)
    if unfit_ops is None and not kernel("decoder_ops").loaded:
        unfit_ops = kernel("decoder_ops").detail
    if unfit_ops is None:
        unfit_ops = probe_ops(loaded.model, compiled_kernel("decoder_ops"))
    if unfit_ops is not None and job.model.compiled_ops:
        raise CbgenError(f"--compiled-ops does not apply here: {unfit_ops}; drop the flag")
    return True, why + ("; norms, rotary and SiLU compiled (--no-compiled-ops: eager)" if unfit_ops is None else
                        f"; norms, rotary and SiLU eager: {unfit_ops}"), unfit_ops is None


def _compiled(cb_config: ContinuousBatchingConfig, generation_config: GenerationConfig) -> bool:
    """Whether transformers will compile the engine's forward pass (which needs its dense attention mask)."""
    return (getattr(cb_config, "default_compile_level", 0) or 0) > 0 or any(
        getattr(cb_config, name, None) is not None for name in ("varlen_compile_config", "decode_compile_config")
    ) or getattr(generation_config, "compile_config", None) is not None


def plan_scope(job: JobConfig, loaded: LoadedModel, attention: str, *, compiled: bool = False,
               kernel_why: str = "off", implementation: str | None = None) -> ScopePlan:
    """What cbgen installs for a job's engine (cbgen.engine.scope), given the attention it runs with; `compiled`:
    transformers compiles the forward pass (which needs its dense mask); `implementation`: the attention
    implementation transformers runs the model with (`engine_attention`; None: the model's own). transformers builds
    its dense mask only for sdpa and paged|eager, and cbgen skips it where its own CPU attention serves sdpa and no
    compiled pass could reach the stock function."""
    implementation = implementation or engine_attention(loaded.model, auto_switch_to_flash=False)
    invariant, why = invariance_choice(job, loaded, attention)
    fused, fused_why, fused_ops = fused_choice(job, loaded)
    if attention == PER_SEQUENCE_ATTENTION and invariant:
        attention = PER_SEQUENCE_INVARIANT
    return ScopePlan(attention=attention, batch_invariant=invariant, invariant_why=why,
                     linear=linear_choice(job, loaded, invariant),
                     linear_kernel=linear_kernel_choice(job, loaded, invariant),
                     dense_mask=mask_needed(implementation) and (attention not in CPU_ATTENTION or compiled),
                     implementation=implementation,
                     lazy_kv_cache=loaded.device == "cpu", fused_layers=fused, fused_why=fused_why, fused_ops=fused_ops,
                     kernel_why=kernel_why)


def plan_scoring_scope(job: JobConfig, loaded: LoadedModel) -> ScopePlan:
    """What cbgen installs while a scoring job's scorer runs (cbgen.score). Where cbgen's compiled attention serves
    the model (on CPU, in one process), by default: rows packed end to end into each forward pass, attended by the
    kernel and their linear layers in fixed blocks, so every row's scores are its own bits (batch-invariant, no
    padding). Elsewhere the scorer attends with the model's own attention and masks over padded batches, and
    --batch-invariant gives every row a forward pass of its own: its shapes, and so its bits, are its own."""
    kernel_reason = _packed_rows_reason(job, loaded)
    if kernel_reason is None:
        return ScopePlan(attention=PACKED_ROWS, batch_invariant=True, linear=linear_choice(job, loaded, invariant=True),
                         linear_kernel=linear_kernel_choice(job, loaded, True),
                         invariant_why="on: rows packed end to end, attended by cbgen's compiled kernel, the linear "
                                       "layers in fixed blocks (--no-batch-invariant turns it off)",
                         kernel_why="on: rows packed end to end")
    if job.model.batch_invariant:
        return ScopePlan(attention=STOCK, batch_invariant=True, linear=linear_choice(job, loaded, invariant=False),
                         linear_kernel=linear_kernel_choice(job, loaded, True),
                         invariant_why="on: each row scored in a forward pass of its own (--batch-invariant)")
    return ScopePlan(attention=STOCK, linear=linear_choice(job, loaded, invariant=False),
                     invariant_why="off: rows of similar length share forward passes (--batch-invariant scores each "
                                   "alone)")


def make_cb_config(batching: dict[str, Any], job: JobConfig, *, per_request: bool = False) -> ContinuousBatchingConfig:
    """The ContinuousBatchingConfig: the batching fields plus the generation-side ones (per-request samplers when
    rows carry their own settings, the seed). Logprobs are never transformers' (those of the processed scores):
    cbgen's step control records the model's own."""
    from transformers.generation import ContinuousBatchingConfig

    fields = dict(batching)
    if per_request:
        fields["per_request_processors"] = True
    if job.generation.seed is not None:
        fields["seed"] = job.generation.seed
    try:
        return ContinuousBatchingConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CbgenError(f"batching: {e}") from None


def _packed_rows_reason(job: JobConfig, loaded: LoadedModel) -> str | None:
    """Why a scoring job does not pack its rows through cbgen's compiled attention, or None when it does."""
    if job.model.batch_invariant is False or job.model.compiled_attention is False:
        return "turned off"
    if loaded.device != "cpu" or job.model.tp_size > 1:
        return f"the kernel is for CPU in one process, and this job runs on {loaded.device}"
    from cbgen.attention import compiled_attention_unavailable_reason, cpu_attention_unavailable_reason

    return cpu_attention_unavailable_reason(loaded.model) or compiled_attention_unavailable_reason(loaded.model)
