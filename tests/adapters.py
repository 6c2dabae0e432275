"""LoRA adapters for the tests, made by PEFT over a model folder, and the reference they are checked against: PEFT's
merged model (`merge_and_unload()`) generating through transformers' `model.generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def make_adapter(base: Path, folder: Path, seed: int, **settings: Any) -> Path:
    """A LoRA adapter over the model in `base`, with random factors drawn from `seed` (PEFT's default starts B at
    zero, an update that changes nothing), saved by PEFT into `folder`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():  # large enough to move greedy tokens of the tiny model
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.mul_(4.0)
    peft_model.save_pretrained(folder)
    return folder


def merged_model(base: Path, adapter: Path | None, dtype: Any = None) -> Any:
    """The model in `base` (float32 unless `dtype`), with `adapter` merged by PEFT's merge_and_unload()."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype or torch.float32).eval()
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def greedy(model: Any, ids: list[int], new_tokens: int, eos: int) -> list[int]:
    import torch

    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos)
    return out[0, len(ids):].tolist()
