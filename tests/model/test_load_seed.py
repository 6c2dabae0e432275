"""Loading a random-weight model (cbgen.model.load) draws the same weights every time, those torch draws after
`torch.manual_seed(0)`, without touching the caller's random state."""

from __future__ import annotations

import torch

from cbgen.config import ModelSection
from cbgen.model import load as model_load
from tests.model.test_model import tiny_config_json


def test_random_weights_leave_the_callers_random_state_alone(tmp_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tiny_config_json(tmp_path, 49152)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    loaded = model_load.load_model(ModelSection(model=str(path), dtype="float32",
                                                cache_dir=str(tmp_path_factory.getbasetemp() / "model-cache")))
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(0)  # the weights a global seed of 0 gave before: outputs of random models are unchanged
    expected = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(tmp_path), dtype=torch.float32)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
