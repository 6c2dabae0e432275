"""Whether a job's LoRA adapters fit its model, from their files and the model's structure alone (a model on torch's
meta device does): each adapted layer exists and is a linear or embedding layer, the low-rank factors' shapes fit it
and each other, an adapted embedding's merge is exact, and the adapter was made for this model (its
adapter_config.json's `base_model_name_or_path`), so that a job stops in one line before any weight loads rather
than mid-job in PEFT, or, worse, runs an adapter of the right shapes trained on another model.

Torch-free: it reads JSON and safetensors headers."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cbgen.errors import CbgenError, first_line
from cbgen.model.adapters import CONFIG_FILE, FACTOR, Adapter, Adapters, safetensors_shapes

ANY_BASE_FLAG = "--adapter-any-base"
HUB_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/")
QUANTIZED_SUFFIX = re.compile(r"[.\-_](?:i?q\d\w*|f16|f32|bf16|fp16|gguf)$")


def factor_layers(shapes: dict[str, list[int]]) -> dict[str, dict[str, list[int]]]:
    """Module path -> {"A": shape, "B": shape} from PEFT's weight names."""
    found: dict[str, dict[str, list[int]]] = {}
    for name, shape in shapes.items():
        match = FACTOR.match(name)
        if match:
            found.setdefault(match.group(1), {})[match.group(3)] = shape
    return found


def misfit(adapter: Adapter, model: Any) -> str | None:
    """Why `adapter` cannot be merged into `model`, or None. Checks what PEFT would otherwise fail on mid-job: each
    adapted layer exists, is a linear or an embedding layer, the low-rank factors' shapes fit its inputs and outputs
    and each other (the rank), and an adapted embedding is not the output layer's too (merged, the update would
    change both, which PEFT's unmerged adapter does not)."""
    weights = adapter.weights
    if weights.suffix != ".safetensors":
        return None  # a pickled file cannot be read without torch; PEFT checks it when it merges
    try:
        layers = factor_layers(safetensors_shapes(weights))
    except (OSError, ValueError, struct.error) as e:
        return f"its weights file {weights.name} cannot be read ({first_line(e)})"
    if not layers:
        return f"its weights file {weights.name} holds no LoRA factors (lora_A / lora_B)"
    modules = dict(model.named_modules())
    for path, factors in sorted(layers.items()):
        reason = _layer_misfit(adapter, model, path, modules.get(path), factors)
        if reason is not None:
            return reason
    return None


def _layer_misfit(adapter: Adapter, model: Any, path: str, layer: Any, factors: dict[str, list[int]]) -> str | None:
    if layer is None:
        return (f"it adapts {path}, which the model does not have (an adapter for another architecture or size? "
                f"its base model: {adapter.config.get('base_model_name_or_path')})")
    embedding = hasattr(layer, "num_embeddings")
    inputs = layer.num_embeddings if embedding else getattr(layer, "in_features", None)
    outputs = layer.embedding_dim if embedding else getattr(layer, "out_features", None)
    if inputs is None or outputs is None:
        return f"it adapts {path}, a {type(layer).__name__}: cbgen merges adapters of linear and embedding layers"
    a, b = factors.get("A"), factors.get("B")
    if a is None or b is None:
        return f"{path} has only one of its two LoRA factors"
    if a[1] != inputs or b[0] != outputs:
        return (f"its update of {path} maps {a[1]} inputs to {b[0]} outputs, the model's layer {inputs} to "
                f"{outputs} (an adapter trained on another model?)")
    if a[0] != b[1]:
        return f"the two factors of {path} have different ranks ({a[0]} and {b[1]})"
    rank = adapter.config.get("r")
    if not adapter.config.get("rank_pattern") and isinstance(rank, int) and a[0] != rank:
        return f"its {CONFIG_FILE} says rank {rank}, and its factors of {path} have rank {a[0]}"
    if embedding and _tied(model, layer):
        return (f"it adapts {path}, whose weights the model's output layer shares (tie_word_embeddings): merged, "
                "the update would change the output layer too, which the adapter does not; cbgen merges embedding "
                "adapters only where the embeddings are the model's own")
    return None


def _tied(model: Any, embedding: Any) -> bool:
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shares = output is not None and getattr(output, "weight", None) is embedding.weight
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return shares or (output is not None and bool(getattr(text, "tie_word_embeddings", False)))


def model_names(model_setting: str | None, structure: Any) -> list[str]:
    """What a model is called, for comparing with an adapter's base model: `--model` as given (the embedded model's
    GGUF file without it) and the name its config was loaded from."""
    from cbgen.model.source import resolve_source

    source = resolve_source(model_setting)
    return with_hub_ids([n for n in (model_setting, source.location, source.gguf_file,
                                     getattr(getattr(structure, "config", None), "_name_or_path", None)) if n])


def with_hub_ids(names: list[str]) -> list[str]:
    """`names`, and the hub id of each that is a folder of the hub's cache (.../models--owner--name/snapshots/...)."""
    return names + [f"{m.group(1)}/{m.group(2)}" for n in names if (m := HUB_SNAPSHOT.search(str(n)))]


def short_name(name: str) -> str:
    """A model's name without its owner, folder or quantization: 'HuggingFaceTB/SmolLM2-135M-Instruct' and
    'SmolLM2-135M-Instruct.Q4_1.gguf' are both 'smollm2-135m-instruct'."""
    short = name.rstrip("/").rsplit("/", 1)[-1].lower()
    while (shorter := QUANTIZED_SUFFIX.sub("", short)) != short:
        short = shorter
    return short


def other_base(adapter: Adapter, names: list[str]) -> str | None:
    """The base model `adapter` names when it is none of the model's names (by path or short name); None: the same
    model, or an adapter that names none."""
    base = adapter.config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip() or not names:
        return None
    base_path = Path(base).expanduser()
    for name in names:
        if short_name(name) == short_name(base):
            return None
        if base_path.exists() and Path(name).expanduser().exists() and \
                Path(name).expanduser().resolve() == base_path.resolve():
            return None
    return base


def check_fits(adapters: Adapters, model: Any, where: str = "--adapter", names: list[str] | None = None,
               any_base: bool = False) -> None:
    """Raises CbgenError, naming the adapter and the first thing that does not fit, unless every adapter fits the
    model's structure and (unless `any_base`) was made for a model of one of its `names`."""
    for adapter in adapters.all:
        reason = misfit(adapter, model)
        if reason is not None:
            raise CbgenError(f"{where} {adapter.spec}: does not fit the model: {reason}")
        base = None if any_base else other_base(adapter, names or [])
        if base is not None:
            raise CbgenError(f"{where} {adapter.spec}: made for {base} (its {CONFIG_FILE}'s base_model_name_or_path), "
                             f"and this job's model is {names[0] if names else '?'}: an adapter trained on another "
                             f"model gives wrong answers without an error; run it on its base model, or pass "
                             f"{ANY_BASE_FLAG} if they are the same model under two names")


def check_section(settings: Any, structure: Callable[[], Any]) -> None:
    """check_fits for the adapters model settings (cbgen.config.ModelSection) name, if any, on the model they name
    (`structure()`, asked for only when there are adapters to check)."""
    from cbgen.model.adapters import section_adapters

    adapters = section_adapters(settings)
    if adapters is not None:
        model = structure()
        check_fits(adapters, model, names=model_names(settings.model, model), any_base=settings.adapter_any_base)
