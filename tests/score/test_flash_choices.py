"""`cbgen score --choices` on a model that runs flash attention: flash reads an attention mask as a [batch, keys]
padding mask, so the scorer must not lay choices side by side behind one prompt under a 4-D custom mask; each
choice goes as its own sequence, and its score is the one it gets alone. Flash attention itself needs a GPU, so a
stand-in registered under its name computes what it computes (causal attention over the unpadded keys) and refuses
any mask but a padding mask, as the real kernel's unpadding would misread it."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from cbgen.score.batches import MaskShape, make_batch, pieces_of
from tests.score.test_scorer import _model, _requests, _score, check_against_forward

FLASH = "flash_attention_2"


def flash_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """[batch, heads, q, d] in, [batch, q, heads, d] out, as transformers' flash_attention_forward."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"flash attention reads a [batch, keys] padding mask, and was given {attention_mask.dim()}-D")
    q_len, k_len = query.shape[2], key.shape[2]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :].bool()
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def flash(monkeypatch):
    monkeypatch.setitem(AttentionInterface._global_mapping, FLASH, flash_stand_in)


def test_choices_under_flash_attention_are_scored_each_alone(flash):
    model = _model("llama", vocab_size=1024)
    requests = _requests(seed=5)
    model.config._attn_implementation = FLASH
    results = _score(model, requests, top_logprobs=2)  # raised: flash was handed the 4-D mask of side-by-side choices
    assert MaskShape.of(model) is None
    choices = next(r for r in requests if r.has_choices)
    pieces = pieces_of(0, choices, side_by_side=MaskShape.of(model) is not None)
    assert len(pieces) == len(choices.continuations)
    batch = make_batch(pieces, MaskShape.of(model), torch.float32, "cpu")
    assert batch.attention_mask is None or batch.attention_mask.dim() == 2
    model.config._attn_implementation = "sdpa"  # the reference: an independent forward pass of each sequence
    assert MaskShape.of(model) is not None
    check_against_forward(model, requests, results, "llama under flash", top_logprobs=2)
