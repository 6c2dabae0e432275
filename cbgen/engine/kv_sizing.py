"""How big the KV cache is, and whether its blocks are shared: sized on CPU for the requests a job keeps in flight,
from what the requests read ahead ask for (the workload's shape)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.config import JobConfig, page_size
from cbgen.records import Request
from cbgen.render.prompts import LOOKAHEAD, prefix_key

if TYPE_CHECKING:
    from cbgen.model.load import LoadedModel

KV_MEMORY_SHARE = 0.25  # on CPU, the KV cache cbgen sizes never takes more than this share of available RAM


@dataclass(frozen=True)
class WorkloadShape:
    """What the engine is sized for, known from the requests read ahead."""

    longest_prompt: int
    max_new_tokens: int  # the most any request asks for
    num_return_sequences: int  # the most any request asks for
    requests: int | None  # in the whole job; None when unknown (stdin)
    shared_pages: bool = True  # some requests read ahead share a first KV page, or ask for several sequences
    # later requests continue earlier ones (a conversation's turns, each prompt starting with the turn before): a
    # request in flight keeps the blocks of the turn before it while another speaks (a simulated user's turn)
    continued: bool = False

    @classmethod
    def of(cls, job: JobConfig, head: Sequence[Request], total: int | None, *, whole: bool = False,
           grows_by: int = 0) -> WorkloadShape:
        """From the requests read ahead (rendered: their token ids; their rows' own caps and n); `whole`: they are
        all the job's, so only those that can run count; `grows_by`: tokens a prompt may gain after its first
        request (a conversation's later turns)."""
        g = job.generation
        runnable = [r for r in head if r.error is None and r.input_ids is not None]
        asked = [r.record.settings for r in runnable]
        n = max([g.num_return_sequences, *(s.get("n") or 0 for s in asked)])
        keys = [key for r in runnable if (key := prefix_key(r.input_ids or [], page_size(job.batching)))]
        return cls(longest_prompt=max((len(r.input_ids or ()) for r in runnable), default=1) + grows_by,
                   max_new_tokens=max([g.max_new_tokens, *(s.get("max_new_tokens") or 0 for s in asked)]),
                   num_return_sequences=n, requests=max(len(runnable), 1) if whole else total,
                   shared_pages=n > 1 or len(set(keys)) < len(keys) or grows_by > 0, continued=grows_by > 0)


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_bytes_per_block(model_config, page_tokens: int, dtype_bytes: int) -> int:
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * heads * head_dim * page_tokens * dtype_bytes


def size_kv_cache(batching: dict[str, Any], loaded: LoadedModel, workload: WorkloadShape, window: int,
                  max_positions: int | None) -> dict[str, Any]:
    """Sets `batching["num_blocks"]` for the job unless the user sized the cache or it is on a GPU; returns how.

    On CPU the engine's default cache takes a share of *system RAM* (measured: 10 GB for one request on SmolLM2 and
    13 s of warm-up), so cbgen gives it room for the requests it keeps in flight: each as long as the longest prompt
    read ahead plus the most new tokens any of them asks for, capped at a share of available memory.
    """
    tokens_per_page = page_size(batching)
    sizing: dict[str, Any] = {"page_size": tokens_per_page, "max_in_flight": window}
    if "num_blocks" in batching:
        return sizing | {"chosen_by": "user (num_blocks)"}
    if "max_memory_percent" in batching or loaded.device != "cpu":
        return sizing | {"chosen_by": "transformers, from max_memory_percent of free device memory"}
    per_request = workload.longest_prompt + workload.max_new_tokens
    if max_positions:
        per_request = min(per_request, max_positions)
    in_flight = min(window, workload.requests) if workload.requests else window
    blocks_per_request = ceil(per_request / tokens_per_page) + 1
    held = 2 if workload.continued else 1  # the turn before's blocks, kept for the next turn to find
    num_blocks = in_flight * workload.num_return_sequences * blocks_per_request * held
    # the engine also plans, per cached token, activations and an attention-mask column: about a quarter more
    block_bytes = kv_bytes_per_block(loaded.model.config, tokens_per_page, loaded.dtype.itemsize)
    planned_bytes = block_bytes * 5 // 4
    available = available_memory_bytes()
    reason = (f"{in_flight} requests in flight x {workload.num_return_sequences} sequences x {blocks_per_request} "
              f"blocks ({workload.longest_prompt} prompt tokens, the longest of the first {LOOKAHEAD} rows, "
              f"+ {workload.max_new_tokens} new)" + (" x 2 (each keeps its turn before)" if held > 1 else ""))
    if available and num_blocks * planned_bytes > KV_MEMORY_SHARE * available:
        num_blocks = max(blocks_per_request, int(KV_MEMORY_SHARE * available // planned_bytes))
        reason += f"; capped at {KV_MEMORY_SHARE:.0%} of available memory"
    batching["num_blocks"] = num_blocks
    # transformers checks the cache against a share of free memory (0.6 on CPU); cbgen has already bounded it
    batching.setdefault("max_memory_percent", 0.9)
    return sizing | {"chosen_by": "cbgen", "reason": reason, "bytes": num_blocks * block_bytes}


def sharing_choice(batching: dict[str, Any], loaded: LoadedModel, workload: WorkloadShape) -> str:
    """Turns transformers' block sharing off on CPU where it cannot pay, and says why. The cache keeps every completed
    block of a finished request for reuse until it runs out of free blocks; since cbgen's cache takes RAM only as
    pages are written (cbgen.engine.kv_memory), blocks kept that no request can reuse would grow a job's memory
    to the whole cache. A block is reused only by a request with the same first page, so with one sequence per
    request and no two prompts read ahead sharing their first page, nothing is lost."""
    if "allow_block_sharing" in batching:
        return f"{'on' if batching['allow_block_sharing'] else 'off'} (batching.allow_block_sharing)"
    if loaded.device != "cpu" or workload.shared_pages:
        return "on"
    batching["allow_block_sharing"] = False
    return (f"off: no two of the first {LOOKAHEAD} prompts share a first page and each asks for one sequence, so no "
            "block could be reused (batching.allow_block_sharing: true turns it on)")


