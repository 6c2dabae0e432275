"""An embedding model's batch packed end to end: no padding, so its linear layers compute only the batch's real tokens.

A padded batch of texts computes every padded position through every linear layer, and padding is what kept batches
small: cut at 8 % padding, 300 sentence-length texts took 20 forward passes of 80 to 3,840 rows. Packed, the rows of a
batch are one sequence of tokens ([1, tokens]) with each text's own positions, and transformers' BertModel runs its
own forward over it: embeddings, layer norms, the MLP and the projections act token by token, so they are the stock
arithmetic over fewer, larger matmuls. Only attention must know where a text starts and ends: while the encoder runs,
the model's "sdpa" attention is cbgen's packed attention (cbgen/kernels/packed_attention.cpp, bound for this model
alone through cbgen.attention.registry), which takes each text's tokens from the offsets the forward is given
(`cu_seq_lens_q`, transformers' name for them in padding-free batches). Pooling then reads each text's own rows.

Where it serves (`unfit_reason`): BERT encoders (BertModel, absolute positions counted from 0) on CPU, in float32,
bfloat16 or float16, with transformers' own forwards, where the kernel builds. Anywhere else the encoder keeps padded
batches through the stock forward, and run.json says why.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

KERNEL = "packed_attention"
PACKED_MODELS = ("BertModel",)
CU_SEQLENS = "cu_seq_lens_q"  # the keyword transformers passes padding-free offsets under, down to attention


def unfit_reason(model: Any, device: str) -> str | None:
    """Why this encoder cannot run packed batches here, or None."""
    name = type(model).__name__
    if name not in PACKED_MODELS:
        return f"{name} is not one of the encoders packed batches are written for ({', '.join(PACKED_MODELS)})"
    config = model.config
    if device != "cpu":
        return "packed batches run cbgen's CPU attention kernel, and the model is on " + device
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"the model attends with {config._attn_implementation!r}, not transformers' sdpa"
    if getattr(config, "is_decoder", False) or getattr(config, "position_embedding_type", "absolute") != "absolute":
        return "the model is a decoder or has relative positions"
    if model.training:
        return "the model is in training mode (dropout)"
    for module in model.modules():
        if "forward" in vars(module):
            return f"{type(module).__name__}'s forward was replaced (another library patched it)"
    from cbgen.kernels import kernel

    built = kernel(KERNEL)
    return None if built.loaded else f"cbgen's packed attention kernel is not available: {built.detail}"


def _packed_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention call (query, key and value [1, heads, tokens, dim]) over a packed batch: each text
    attends to its own tokens. A call without offsets (the model used otherwise meanwhile) goes to the stock sdpa."""
    offsets = kwargs.get(CU_SEQLENS)
    if offsets is None or query.shape[0] != 1 or attention_mask is not None or dropout:
        from cbgen.attention.registry import stock

        return stock("sdpa")(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.cbgen_kernels.packed_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                                   value[0].transpose(0, 1), offsets, scale)
    return out.unsqueeze(0), None


@contextmanager
def packed_attention(model: Any) -> Iterator[None]:
    """While the block runs, the model's sdpa attention calls that carry packed offsets go to cbgen's kernel."""
    from cbgen.attention.registry import bound

    with bound(model, "sdpa", _packed_sdpa):
        yield


def packed_inputs(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """One packed batch: the token ids [1, tokens], each row's positions from 0 [1, tokens], and the offsets where
    each row starts (int64 [rows + 1], from 0 to tokens)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)
    starts = torch.repeat_interleave(offsets[:-1], lengths)
    positions = torch.arange(int(offsets[-1])) - starts
    return ids[None].to(device), positions[None].to(device), offsets


def forward(model: Any, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's last hidden states of the packed rows ([tokens, dim]) and their offsets; inside
    `packed_attention(model)` and torch.inference_mode."""
    device = next(model.parameters()).device
    ids, positions, offsets = packed_inputs(rows, device)
    out = model(input_ids=ids, position_ids=positions, token_type_ids=torch.zeros_like(ids),
                **{CU_SEQLENS: offsets, "max_length_q": int((offsets[1:] - offsets[:-1]).max())})
    return out[0][0], offsets


def pool_packed(hidden: torch.Tensor, offsets: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """Each row's token vectors ([tokens, dim], rows laid end to end at `offsets`) pooled by `mode` (mean, cls, max,
    mean_sqrt_len, last), as cbgen.encoders.pooling pools a padded batch; unit length when `normalize`."""
    lengths = offsets[1:] - offsets[:-1]
    starts, ends = offsets[:-1].to(hidden.device), offsets[1:].to(hidden.device)
    if mode == "cls":
        pooled = hidden[starts]
    elif mode == "last":
        pooled = hidden[ends - 1]
    else:
        segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(hidden.device)
        index = segment.unsqueeze(1).expand(-1, hidden.shape[1])
        if mode == "max":
            pooled = hidden.new_full((len(lengths), hidden.shape[1]), torch.finfo(hidden.dtype).min)
            pooled.scatter_reduce_(0, index, hidden, "amax")
        else:
            summed = hidden.new_zeros((len(lengths), hidden.shape[1])).scatter_add_(0, index, hidden)
            counts = lengths.to(hidden.device, hidden.dtype).unsqueeze(1).clamp(min=1e-9)
            pooled = summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)
    return torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled
