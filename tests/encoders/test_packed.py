"""Packed embedding batches (cbgen.encoders.packed): a BERT encoder's texts laid end to end, no padding, give the
embeddings the stock padded forward gives (float32, to float rounding), under every pooling; run.json says which ran
and why; a model the packed forward was not written for, --padded, and a machine without the kernel run padded
batches, saying so."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.encoders.packed import pool_packed
from cbgen.encoders.pooling import pool
from tests.encoders.test_embed import bert_folder, embed, texts
from tests.helpers import fresh_caches, property_examples


def _vectors(rows: dict[str, dict], n: int) -> np.ndarray:
    return np.array([rows[f"r{i}"]["embedding"] for i in range(n)], dtype=np.float32)


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "mean_sqrt_len"])
def test_packed_batches_give_the_padded_forward_embeddings(tmp_path, pooling):
    folder = bert_folder(tmp_path, pooling, pooling == "mean", max_seq_length=64)
    sentences = texts(70, seed=4, longest=90)  # 1 to 90 words: some are cut at 64 tokens
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(sentences)]
    packed = embed(tmp_path, folder, rows, "--embed-batch-tokens", "300", name="packed")
    padded = embed(tmp_path, folder, rows, "--padded", name="padded")
    np.testing.assert_allclose(_vectors(packed, 70), _vectors(padded, 70), rtol=1e-5, atol=2e-6)
    runs = {name: json.loads((tmp_path / name / "run.json").read_text())["scorer"] for name in ("packed", "padded")}
    assert runs["packed"]["packed"] == {"on": True, "why": "each text's own tokens, no padding"}
    assert runs["packed"]["padded_tokens"] == 0 and runs["packed"]["forward_passes"] > 1
    assert runs["padded"]["packed"] == {"on": False, "why": "padded batches asked for"}
    assert runs["padded"]["padded_tokens"] > 0


def test_other_encoders_and_a_machine_without_the_kernel_run_padded_batches(tmp_path, monkeypatch):
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertModel

    bert = bert_folder(tmp_path, "mean", True)
    folder = tmp_path / "distilbert"
    AutoTokenizer.from_pretrained(bert).save_pretrained(folder)
    torch.manual_seed(0)
    DistilBertModel(DistilBertConfig(vocab_size=30522, dim=32, n_layers=1, n_heads=2, hidden_dim=64)
                    ).save_pretrained(folder)
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(texts(6))]
    done = embed(tmp_path, folder, rows, name="distil")
    assert all(row["error"] is None for row in done.values())
    why = json.loads((tmp_path / "distil" / "run.json").read_text())["scorer"]["packed"]
    assert why["on"] is False and why["why"].startswith("DistilBertModel is not one of the encoders")
    # no compiled kernels at all (CBGEN_NO_KERNELS=1): the BERT encoder pads, and the rows are still right
    from cbgen.kernels import build

    monkeypatch.setenv(build.DISABLE_ENV, "1")
    fresh_caches(monkeypatch, "kernel builds", "kernel states said")
    plain = embed(tmp_path, bert, rows, name="nokernel")
    assert all(row["error"] is None for row in plain.values())
    why = json.loads((tmp_path / "nokernel" / "run.json").read_text())["scorer"]["packed"]
    assert why["on"] is False and "compiled kernels are off" in why["why"]


@settings(max_examples=property_examples(40), deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8),
       mode=st.sampled_from(["mean", "cls", "max", "mean_sqrt_len", "last"]), normalize=st.booleans(),
       seed=st.integers(0, 2**16))
def test_packed_pooling_is_padded_pooling(lengths, mode, normalize, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(lengths), max(lengths), 16, generator=generator)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    packed = torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    torch.testing.assert_close(pool_packed(packed, offsets, mode, normalize), pool(hidden, mask, mode, normalize),
                               rtol=1e-5, atol=1e-6)
