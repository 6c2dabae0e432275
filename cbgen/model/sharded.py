"""Loading a model sharded over a tensor-parallel group (cbgen.parallel.tensor): transformers' `DistributedConfig`, with
a plan that keeps attention replicated when its heads do not split over the group."""

from __future__ import annotations

from pathlib import Path

import torch

from cbgen.errors import CbgenError
from cbgen.model.gguf import CACHE_HIT, CACHE_OFF, GgufCache, gguf_tokenizer, load_gguf, model_entry
from cbgen.model.source import ModelSource
from cbgen.parallel.tensor import GGUF_CACHE, GGUF_READY


def load_sharded(source: ModelSource, cache_root: Path | None, tp, dtype: torch.dtype, **load_kwargs):
    """The model sharded over the tensor-parallel group `tp` (cbgen.parallel.tensor), and its tokenizer.

    A GGUF model is sharded from its converted cache: rank 0 converts it first when the cache misses (one rank
    dequantizes, the others wait), since a sharded model cannot save the whole one. A model whose attention heads do
    not split `tp.size` ways keeps its attention replicated and shards its MLP and embeddings.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    if source.random_weights:
        raise CbgenError(f"--model {source.name}: random-weight models are built in one process; --tp needs weights "
                         "from a folder, the hub or a .gguf file")
    status = None
    location, extra = source.location, dict(load_kwargs)
    if source.gguf_file:
        gguf = source.gguf_path
        cache = GgufCache(cache_root, gguf) if cache_root else None
        entry = model_entry(dtype)
        if cache is not None:
            if tp.share(GGUF_CACHE, cache.find(entry) is None):  # rank 0 decides, so every rank takes the same path
                if tp.driver:
                    load_gguf(source, cache, dtype, device_map="cpu", **load_kwargs)
                tp.share(GGUF_READY)
            folder = cache.find(entry)
            if folder is None:
                raise CbgenError(f"--model {source.name}: the converted model could not be cached in "
                                 f"{cache.folder}, and --tp loads from there; check that it is writable")
            location, status = str(folder), CACHE_HIT
            tokenizer, _ = gguf_tokenizer(gguf, cache)
        else:
            extra["gguf_file"] = source.gguf_file
            tokenizer, status = gguf_tokenizer(gguf, None)
            status = CACHE_OFF
    else:
        tokenizer = AutoTokenizer.from_pretrained(location, **load_kwargs)
    config = AutoConfig.from_pretrained(location, **{k: v for k, v in extra.items() if k == "gguf_file"},
                                        trust_remote_code=load_kwargs.get("trust_remote_code", False))
    plan = attention_plan(config, tp.size)
    distributed = DistributedConfig(tp_size=tp.size, tp_plan=plan) if plan else DistributedConfig(tp_size=tp.size)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, distributed_config=distributed, **extra)
    if plan:
        # the paged cache splits the KV heads whenever the plan names k_proj/v_proj, whatever their style
        # (tp_plan has a setter, which the type checker does not see)
        model.tp_plan = {k: v for k, v in model.tp_plan.items() if v != "replicate"}  # type: ignore[misc]
    return model, tokenizer, status


def attention_plan(config, tp_size: int) -> dict[str, str] | None:
    """None when the attention heads split `tp_size` ways (transformers' own plan applies); else a plan that
    replicates the attention projections so only the MLP and the embeddings are sharded."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp_size == 0 and kv_heads % tp_size == 0:
        return None
    return {f"model.layers.*.self_attn.{name}_proj": "replicate" for name in "qkvo"}
