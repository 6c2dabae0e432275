"""How a sequence ended: its finish reason, and the tokens, logprobs and text kept of it.

A stop string cuts the sequence where the string began; the loop stop (cbgen.control) drops the end of sequence it
forced and reports "repetition"; otherwise a sequence stops at its end-of-sequence token or at its token budget.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from cbgen.records import Completion, Request

if TYPE_CHECKING:
    from cbgen.control.processor import StepControl


def ended(request: Request, sample_index: int, result: Any, tokens: list[int], stopped: tuple[int, str] | None,
          control: StepControl | None, *, eos_token_ids: Collection[int], max_new_tokens: int) -> Completion:
    """A sequence that has ended, with what the step control recorded of it (its own logprobs, top logprobs,
    whether its format was complete)."""
    record = control.take(result.request_id) if control is not None else None
    logprobs = top = None
    if control is not None and record is not None and control.capture:
        logprobs, top = record.logprobs[: len(tokens)], record.top[: len(tokens)] or None

    def cut_at(cut: int, reason: str, text: str | None = None) -> Completion:
        return Completion(request, sample_index, tokens[:cut], logprobs[:cut] if logprobs else logprobs,
                          reason, None, text, top_logprobs=top[:cut] if top else top)

    if stopped is not None:
        completion = cut_at(stopped[0], "stop", stopped[1])
        if control is not None and record is not None and record.grammar and not control.accepts(request, stopped[1]):
            completion.finish_reason = "error"
            completion.error = ("a stop string ended the sequence before its response_format was complete: "
                                f"{request.stop!r}")
        return completion
    if record is not None and record.looped and result.error is None:  # the loop stop: drop the end it forced
        return cut_at(len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0), "repetition")
    reason = finish_reason(tokens, max_new_tokens, result.error, eos_token_ids)
    error = str(result.error) if result.error is not None else None
    return Completion(request, sample_index, tokens, logprobs, reason, error, top_logprobs=top)


def finish_reason(tokens: list[int], max_new_tokens: int, error: Any, eos_token_ids: Collection[int]) -> str:
    if error is not None:
        return "error"
    if tokens and tokens[-1] in eos_token_ids:
        return "stop"
    return "length" if len(tokens) >= max_new_tokens else "stop"
