"""What transformers' continuous batching decides by itself once a manager is built, worked out ahead so that the
engine's plan (cbgen.engine.setup) is made for what will run: the attention implementation its manager switches the
model to (flash attention where installed), whether that builds the dense attention mask, its largest batch when the
job names none, and the synchronous loop a step control needs (no CUDA graphs, no async batching)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cbgen.errors import CbgenError

if TYPE_CHECKING:
    from cbgen.control.needs import StepPlan


def max_requests_per_batch() -> int:
    """The most requests transformers puts in one batch when the job does not say (its fallback default): the
    in-flight window keeps twice that many ready, so a GPU batch is never short of requests."""
    from transformers.generation.continuous_batching.initialization import FALLBACK_DEFAULTS

    return int(FALLBACK_DEFAULTS["max_requests_per_batch"])


GRAPH_SETTINGS = ("use_cuda_graph", "use_async_batching")


def synchronous_loop(batching: dict[str, Any], steps: StepPlan) -> None:
    """Turns CUDA graphs and async batching off for a job with a step control, whose processors run Python between
    the forward pass and sampling (reading tokens on the host, llguidance's matchers): inside a captured graph they
    would be recorded once and replayed, or fail. A setting that forces either on is refused in one line."""
    for name in GRAPH_SETTINGS:
        value = batching.get(name)
        if value is True or (isinstance(value, (tuple, list)) and any(value)):
            raise CbgenError(f"batching.{name} is on, and this job needs cbgen's step control ({steps.why()}), which "
                             "runs between the forward pass and sampling where a captured CUDA graph cannot: drop "
                             f"{name} (--no-cuda-graph), or the settings that need the step control")
        batching[name] = False


def engine_attention(model: Any, auto_switch_to_flash: bool = True) -> str:
    """The attention implementation transformers' continuous batching will run `model` with: its
    `switch_to_cb_friendly_attn`, worked out without switching anything. An sdpa or eager model runs flash
    attention 3, else 2, where one is installed and the model supports it (unless auto_switch_to_flash is off);
    eager runs as paged|eager."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available
    from transformers.utils.generic import is_flash_attention_requested

    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    flash = is_flash_attention_requested(requested_attention_implementation=implementation)
    if not flash and implementation != "paged|eager" and auto_switch_to_flash \
            and getattr(model, "_supports_flash_attn", False):
        if is_flash_attn_3_available(kernels_fallback_ok=True):
            implementation = "flash_attention_3"
        elif is_flash_attn_2_available(kernels_fallback_ok=True):
            implementation = "flash_attention_2"
    return "paged|eager" if implementation == "eager" else implementation


def mask_needed(implementation: str) -> bool:
    """Whether transformers' continuous batching builds its dense attention mask for this implementation (flash
    attention reads the cumulative sequence lengths instead)."""
    from types import SimpleNamespace

    from transformers.generation.continuous_batching.utils import attn_mask_is_needed

    return bool(attn_mask_is_needed(SimpleNamespace(_attn_implementation=implementation)))  # type: ignore[arg-type]
