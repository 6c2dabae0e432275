"""The model split where scoring needs it: the decoder's hidden states, and the output head applied to only the
positions that are scored, a bounded chunk at a time.

A causal LM's forward computes logits for every position: tokens × vocabulary floats, 6.4 GB for a 32k-token text
with a 49k vocabulary, and more again for their log-softmax. The scorer runs the decoder once, keeps the hidden
states of the positions that predict a scored token, and projects them through the output head in chunks, so at
most a chunk × vocabulary of logits exists at once. The head applies what the model's own forward applies after
its projection (Gemma's final soft-capping, Cohere's logit scale, Granite's logit scaling); `check_head` compares
the two ways on a short probe when a scorer starts, so an architecture that does something else is refused
rather than scored wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cbgen.errors import CbgenError

LOGITS_BYTES = 64 << 20  # float32 logits held at once (with their log-softmax, twice that)


def decoder_of(model: Any) -> torch.nn.Module:
    """The module that turns token ids into the last hidden states (the causal LM without its output head)."""
    decoder = model.get_decoder()
    if decoder is model:
        raise CbgenError(f"{type(model).__name__} has no separate decoder for cbgen score to run; score with a causal "
                         "LM whose head is an output projection (Llama, Qwen, Mistral, Gemma, ...)")
    return decoder


def output_head(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden states (N, hidden) -> the model's own logits (N, vocabulary), as its forward computes them."""
    projection = model.get_output_embeddings()
    if projection is None:
        raise CbgenError(f"{type(model).__name__} has no output projection for cbgen score to apply")
    text = model.config.get_text_config()
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(model, "logit_scale", None)  # Cohere: a multiplier
    scaling = getattr(text, "logits_scaling", None)  # Granite: a divisor

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = projection(hidden)
        if scale is not None:
            logits = logits * scale
        if scaling is not None:
            logits = logits / scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return head


def chunk_positions(vocab_size: int) -> int:
    """How many positions' logits are worked at once, to hold about LOGITS_BYTES of them."""
    return max(1, LOGITS_BYTES // (4 * vocab_size))


@torch.inference_mode()
def check_head(model: Any, head: Callable[[torch.Tensor], torch.Tensor], probe: list[int]) -> None:
    """Raises CbgenError when decoder + head do not give the log-softmax of the model's own forward on `probe`
    (a few token ids): an architecture whose forward does more after its projection than `output_head` knows."""
    device = next(model.parameters()).device
    ids = torch.tensor([probe], device=device)
    own = model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
    hidden = decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
    ours = head(hidden).float().log_softmax(-1)
    tolerance = 1e-3 if hidden.dtype == torch.float32 else 0.1  # bf16 rounds on its own: a missing step is far more
    difference = float((own - ours).abs().max())
    if not difference <= tolerance:
        raise CbgenError(f"cbgen score cannot reproduce {type(model).__name__}'s own logits (they differ by "
                         f"{difference:.3g} on a probe): its forward does something after the output projection "
                         "that the scorer does not know; please report it with the model's name")
