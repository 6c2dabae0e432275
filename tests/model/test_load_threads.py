"""Two models loaded in two threads at once (two cbgen.Generators): transformers' loading swaps process-wide
functions while it runs (weight tying and initialisation turned off), so a model another thread built meanwhile came
out with its tied output layer left on the meta device, and packing it for a kernel failed (`linear_pack ... Meta
tensors`). cbgen loads one model at a time in a process: the race below, with one load slowed inside transformers'
patches, repeated, leaves every model whole."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from cbgen.config import ModelSection
from cbgen.model import load as model_load


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, tiny_model_dir):
    """A tiny Llama whose output layer is its embeddings (as SmolLM2's): the checkpoint holds them once."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tied")
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(AutoTokenizer.from_pretrained(tiny_model_dir)),
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def _whole(model) -> list[str]:
    problems = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        problems.append("lm_head not tied")
    return problems


def _race(folder, monkeypatch, rounds: int) -> list[list[str]]:
    """`rounds` times: a bfloat16 load lingers while transformers builds its model (inside its process-wide patches:
    the default dtype set, weight tying turned off) and a float32 load runs meanwhile in another thread. What is
    wrong afterwards: a model with a meta or untied parameter, the process's default dtype or tie_weights not put
    back."""
    built = LlamaForCausalLM.__init__

    def lingering(self, *args, **kwargs):
        built(self, *args, **kwargs)
        if threading.current_thread().name == "slow":
            time.sleep(0.3)

    monkeypatch.setattr(LlamaForCausalLM, "__init__", lingering)
    tie = PreTrainedModel.tie_weights
    found: list[list[str]] = []
    for _ in range(rounds):
        models: dict[str, object] = {}

        def load(name, dtype, models=models):
            models[name] = model_load.load_model(ModelSection(model=str(folder), dtype=dtype, device="cpu")).model

        slow = threading.Thread(target=load, args=("slow", "bfloat16"), name="slow")
        slow.start()
        time.sleep(0.1)
        fast = threading.Thread(target=load, args=("fast", "float32"), name="fast")
        fast.start()
        slow.join(60)
        fast.join(60)
        found += [_whole(models[name]) for name in ("slow", "fast")]
        found.append([] if torch.get_default_dtype() == torch.float32 else ["the default dtype was left changed"])
        found.append([] if PreTrainedModel.tie_weights is tie else ["tie_weights was left patched"])
        torch.set_default_dtype(torch.float32)
        PreTrainedModel.tie_weights = tie  # type: ignore[method-assign]
    return found


def test_two_threads_loading_at_once_each_get_a_whole_model(tied_model, monkeypatch):
    assert all(problems == [] for problems in _race(tied_model, monkeypatch, rounds=4))


def test_without_one_load_at_a_time_the_race_breaks_a_model(tied_model, monkeypatch):
    """The control: with loads let overlap, the same race leaves the process changed (and later models broken)."""
    monkeypatch.setattr(model_load, "LOADING", contextlib.nullcontext())
    assert any(problems for problems in _race(tied_model, monkeypatch, rounds=2))
