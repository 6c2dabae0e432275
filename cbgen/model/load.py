"""Loading the model and its tokenizer as the job's `model` section says: device, dtype and attention resolved, the
converted-GGUF cache used, random weights built on the device, or the model sharded over a tensor-parallel group.

Loading changes nothing of the process that outlives it: transformers' logging is quietened only while it runs
(cbgen.process.quiet), and random weights are drawn from torch's generators seeded 0 inside `torch.random.fork_rng`,
so the caller's random state is what it was. What loading sets is the loaded model's own, and stays with it: the
generation config read from the checkpoint's generation_config.json (on a structure-only model), a dequantized GGUF
model's `config._is_quantized` taken off (cbgen.model.gguf: it saves and runs as a safetensors model), `eval()`; and
once an engine has fused its decoder layers, their projections are views of the merged weights (cbgen.model.fused).
Everything an engine changes for a run is its scope's, undone when it ends (cbgen.engine.scope).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cbgen.cache_root import default_cache_dir
from cbgen.config import ModelSection
from cbgen.config.cpu import cpu_row
from cbgen.errors import CbgenError, first_line
from cbgen.model.gguf import GgufCache, gguf_tokenizer, load_gguf, model_entry
from cbgen.model.gguf_parse import parsed_once
from cbgen.model.source import INSTALL_EMBEDDED, ModelSource, embedded_model_path, random_model_config, resolve_source
from cbgen.process.quiet import quiet

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What AutoModelForCausalLM builds: a model that generates (for the type checker; no such class runs)."""

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# One load at a time in a process: transformers' loading swaps process-wide functions while it runs (weight tying and
# initialisation turned off, the default dtype set), so a model another thread builds meanwhile (a second Generator's)
# could come out with untied weights left on the meta device
LOADING = threading.RLock()


def resolve_device(device: str) -> str:
    """Where the model runs: "cpu" or "cuda" (the process's current CUDA device: pick a GPU with
    CUDA_VISIBLE_DEVICES)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise CbgenError("--device cuda: no CUDA device is visible to torch; use --device cpu or auto")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device == "cuda":  # bf16 where the GPU computes it (Ampere and later), else float16 (its range: rarely an issue)
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return _DTYPES[cpu_row().dtype]  # on CPU: the CPU-kind table's (cbgen.config.cpu)


PER_SEQUENCE = "per-sequence"  # cbgen's CPU attention for continuous batching (cbgen.attention), on top of sdpa


def resolve_attn_implementation(requested: str | None, device: str, supports_flash=lambda: True) -> str | None:
    """The implementation the model is loaded with. Asked for by name: that one (per-sequence runs on top of sdpa).
    Else, on CUDA, flash attention (3, else 2) when it is installed and the model supports it (no attention mask:
    much faster under continuous batching); everywhere else None: transformers' own choice, sdpa where the model has
    it, else eager (Gemma 2 and gpt-oss have no sdpa), which continuous batching runs as paged|eager. On CPU, cbgen's
    per-sequence attention then serves the sdpa models while the engine runs. `supports_flash` says whether the
    model's class supports flash attention (asked only when flash is installed)."""
    if requested == PER_SEQUENCE:
        return "sdpa"
    if requested:
        return requested
    if device == "cuda":
        from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

        for version, available in ((3, is_flash_attn_3_available), (2, is_flash_attn_2_available)):
            if available() and supports_flash():
                return f"flash_attention_{version}"
    return None


def _supports_flash(source: ModelSource, trust_remote_code: bool) -> bool:
    """Whether the model class transformers would build for `source` supports flash attention (read from its
    config; no weights are loaded). Unknown counts as no: transformers' own choice is always safe."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if source.random_weights:
            config = random_model_config(source)
        else:
            config = AutoConfig.from_pretrained(source.location, gguf_file=source.gguf_file,
                                                trust_remote_code=trust_remote_code)
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # noqa: BLE001 - remote code, unknown architectures: let transformers choose
        return False
    return bool(getattr(model_class, "_supports_flash_attn", False))


@dataclass
class LoadedModel:
    """A loaded model and what it was loaded as. What loading set on `model` is its own (see the module): its
    generation config, a dequantized GGUF's config, eval mode, and after a fused engine its merged projections."""

    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    source: ModelSource
    device: str
    dtype: torch.dtype
    attn_implementation: str
    load_seconds: float
    # The converted-GGUF cache: hit | miss (written) | off | unwritable | unsupported | not needed (read as int8);
    # None when no GGUF was read
    cache: str | None = None
    quantized: dict | None = None  # what --quantize int8 made (cbgen.model.int8.Quantized.summary), or None

    @property
    def random_weights(self) -> bool:
        return self.source.random_weights


def _random_shape(source: ModelSource, cache_root: Path | None):
    """The config a random-weight source describes, the embedded SmolLM2 tokenizer, and its cache status."""
    config = random_model_config(source)
    gguf = embedded_model_path()
    if gguf is None:
        raise CbgenError(f"--model {source.name}: random-weight models use the embedded SmolLM2 tokenizer, which is "
                         f"not installed: run `{INSTALL_EMBEDDED}`")
    tokenizer, status = gguf_tokenizer(gguf, GgufCache(cache_root, gguf) if cache_root else None)
    return config, tokenizer, status


def _load_random(source: ModelSource, cache_root: Path | None, dtype: torch.dtype, device: str, attn: str | None):
    """A model of the source's shape with random weights (seeded), and the embedded SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM

    config, tokenizer, status = _random_shape(source, cache_root)
    vocab_size = config.get_text_config().vocab_size
    if vocab_size < len(tokenizer):
        raise CbgenError(f"--model {source.name}: vocab_size {vocab_size} is smaller than the SmolLM2 tokenizer's "
                         f"{len(tokenizer)} tokens, so prompts could hold ids the model has no embedding for")
    # the same weights every time, and the caller's random state left as it was; initialised on the device (an 8B
    # model is not built on the CPU first)
    cuda = list(range(torch.cuda.device_count())) if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model, tokenizer, status


def _tokenizer_and_config(source: ModelSource, cache_root: Path | None, dtype: torch.dtype,
                          trust_remote_code: bool):
    """The model's tokenizer and config, its converted-GGUF cache status, and the folder where its weights' own
    generation_config.json would be (None when there is none): nothing of the weights is read."""
    from transformers import AutoConfig, AutoTokenizer

    kwargs = {"trust_remote_code": trust_remote_code}
    status = None
    folder: str | Path | None = None
    if source.random_weights:
        config, tokenizer, status = _random_shape(source, cache_root)
    elif source.gguf_file:
        cache = GgufCache(cache_root, source.gguf_path) if cache_root else None
        tokenizer, status = gguf_tokenizer(source.gguf_path, cache)
        folder = cache.find(model_entry(dtype)) if cache is not None else None
        config = (AutoConfig.from_pretrained(folder, **kwargs) if folder is not None
                  else AutoConfig.from_pretrained(source.location, gguf_file=source.gguf_file, **kwargs))
    else:
        tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
        config = AutoConfig.from_pretrained(source.location, **kwargs)
        folder = source.location
    return tokenizer, config, status, folder


def load_tokenizer(settings: ModelSection):
    """The model's tokenizer and config alone, as loading it would give them (for planning before any model loads:
    a pipeline's stages). Raises CbgenError for anything the user can fix."""
    source = resolve_source(settings.model)
    dtype = resolve_dtype(settings.dtype, resolve_device(settings.device))
    cache_root = default_cache_dir(settings) if settings.use_cache else None
    try:
        with parsed_once():
            tokenizer, config, _, _ = _tokenizer_and_config(source, cache_root, dtype, settings.trust_remote_code)
    except (OSError, ValueError) as e:
        raise CbgenError(f"--model {source.name}: cannot load its tokenizer: {first_line(e)}") from None
    return tokenizer, config


def _structure(source: ModelSource, cache_root: Path | None, dtype: torch.dtype, attn: str | None,
               trust_remote_code: bool):
    """The model's structure without its weights (on torch's meta device: no memory, no dequantization), and its
    tokenizer: what planning a job needs, for a dry run or a main process that never generates."""
    from transformers import AutoModelForCausalLM

    tokenizer, config, status, folder = _tokenizer_and_config(source, cache_root, dtype, trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                 trust_remote_code=trust_remote_code)
    # from_config derives the generation config from the model's config; loading the weights reads the checkpoint's
    # generation_config.json, whose stop tokens and defaults the plan must see too (Llama 3's lists <|eot_id|>)
    saved = _saved_generation_config(folder) if folder is not None else None
    if saved is not None:
        model.generation_config = saved
    return model, tokenizer, status


def _saved_generation_config(folder: str | Path):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError):  # none saved: the one derived from the config is what loading would use too
        return None


def gguf_unconverted(settings: ModelSection) -> bool:
    """Whether loading the model's weights would convert a GGUF file that the converted-GGUF cache does not hold yet
    (then the first load writes it, and later ones read it)."""
    source = resolve_source(settings.model)
    if not source.gguf_file or not settings.use_cache:
        return False
    entry = model_entry(resolve_dtype(settings.dtype, resolve_device(settings.device)))
    return GgufCache(default_cache_dir(settings), source.gguf_path).find(entry) is None


def _load(source: ModelSource, settings: ModelSection, tp, weights: bool, cache_root: Path | None, device: str,
          dtype: torch.dtype, attn: str | None, kwargs: dict):
    """The model, its tokenizer and the converted-GGUF cache status, loaded as `load_model` was asked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not weights:
        return _structure(source, cache_root, dtype, attn, settings.trust_remote_code)
    if tp is not None:
        from cbgen.model.sharded import load_sharded

        return load_sharded(source, cache_root, tp, dtype, attn_implementation=attn, **kwargs)
    if source.random_weights:
        return _load_random(source, cache_root, dtype, device, attn)
    if source.gguf_file:
        gguf = source.gguf_path
        return load_gguf(source, GgufCache(cache_root, gguf) if cache_root else None, dtype, attn_implementation=attn,
                         device_map=device, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, attn_implementation=attn,
                                                 device_map=device, **kwargs)
    return model, tokenizer, None


def load_model(settings: ModelSection, tp=None, *, weights: bool = True) -> LoadedModel:
    """Loads model and tokenizer as `settings` say; sharded over `tp` (cbgen.parallel.tensor.TensorParallel) when given;
    without `weights`, the model's structure only (see `_structure`). The LoRA adapters `settings` name are checked
    against the structure first (they are merged while their rows run: cbgen.model.adapters). Raises CbgenError for
    anything the user can fix."""
    source = resolve_source(settings.model)
    if weights and settings.adapter is not None:  # an adapter that does not fit stops before the weights load
        from cbgen.model.adapter_fit import check_section

        # against the structure: its layers on torch's meta device, no weight read
        check_section(settings, lambda: load_model(settings, weights=False).model)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    if weights and settings.onednn_linear:  # a setting this machine cannot run stops before the weights load
        from cbgen.model.linear import onednn_refusal

        refusal = onednn_refusal(device, dtype, settings.tp_size)
        if refusal is not None:
            raise CbgenError(refusal)
    attn = resolve_attn_implementation(settings.attn_implementation, device,
                                       lambda: _supports_flash(source, settings.trust_remote_code))
    start = time.perf_counter()
    kwargs = {"trust_remote_code": settings.trust_remote_code}
    cache_root = default_cache_dir(settings) if settings.use_cache else None
    cache = None
    try:
        with LOADING, quiet("transformers"), parsed_once():  # quiet: its bars would break the job's display;
            # parsed_once: a GGUF file is read once for tokenizer, config and weights (cbgen.model.gguf_parse), and
            # for its weight type where that is not known yet
            quantize = _quantize_choice(settings, source, weights, device)
            wanted = dtype
            if quantize:
                dtype = torch.float32  # the file's int8 values come back exactly from float32 (cbgen.model.int8)
            read = _read_q8_0(source, settings, cache_root, attn) if quantize == Q8_0_FILE else None
            if isinstance(read, tuple):
                model, tokenizer, cache, quantized = read
            else:
                model, tokenizer, cache = _load(source, settings, tp, weights, cache_root, device, dtype, attn, kwargs)
                quantized = _quantized(model, quantize, read)
            if quantized is not None and settings.quantize == "w8a8":
                from cbgen.model.int8 import use_w8a8

                quantized |= use_w8a8(model)
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1 is set: only models already in the local cache can load)" if offline else ""
        raise CbgenError(f"--model {source.name}: cannot load: {first_line(e)}{hint}") from None
    except ValueError as e:
        raise CbgenError(f"--model {source.name}: {first_line(e)}") from None
    if quantized is not None and wanted != dtype:  # the rest of the model in the dtype asked for (bfloat16: the
        from cbgen.model.int8 import cast_around  # int8 kernel's bfloat16 path where the CPU has bfloat16 units)

        cast_around(model, wanted)
        dtype = wanted
    model.eval()
    chosen = getattr(model.config, "_attn_implementation", None) or attn or "sdpa"
    return LoadedModel(model, tokenizer, source, device, dtype, chosen, time.perf_counter() - start, cache, quantized)


INT8 = "int8"  # the model's float weights quantized as it loads
Q8_0_FILE = "q8_0 file"  # a Q8_0 GGUF file's int8 values read as they are (cbgen.model.q8_0)


def _quantize_choice(settings: ModelSection, source: ModelSource, weights: bool, device: str) -> str | None:
    """Whether the decoder layers' weights are held as int8 (`--quantize`; auto: a Q8_0 GGUF file's), and how they
    are had (INT8 or Q8_0_FILE), or None; refused in one line where they cannot be."""
    from cbgen.model import int8

    if not weights or settings.quantize == "none":
        return None
    reason = int8.refusal(settings.quantize if settings.quantize != "auto" else "int8", settings.adapter is not None,
                          settings.tp_size, device)
    if settings.quantize == "auto" and (not source.gguf_file or reason is not None):
        return None  # a Q8_0 file with adapters or --tp runs dequantized, as before
    if reason is not None:
        raise CbgenError(reason)
    if not source.gguf_file:
        return INT8
    memo = default_cache_dir(settings) / "digests.json" if settings.use_cache else None
    if int8.gguf_is_q8_0(source.gguf_path, memo):
        return Q8_0_FILE
    return INT8 if settings.quantize in ("int8", "w8a8") else None


def _read_q8_0(source: ModelSource, settings: ModelSection, cache_root: Path | None, attn: str | None):
    """(model, tokenizer, cache status, what was quantized) read straight from a Q8_0 file, or why it cannot be."""
    from cbgen.model.gguf import CACHE_DIRECT, combine_statuses
    from cbgen.model.q8_0 import Unfit, file_table, load_q8_0

    cache = GgufCache(cache_root, source.gguf_path) if cache_root else None
    tokenizer, status = gguf_tokenizer(source.gguf_path, cache)
    try:
        model, done = load_q8_0(source.gguf_path, file_table(source.gguf_path, cache), attn)
    except Unfit as e:
        log.info("cbgen: %s: %s; it loads dequantized and is quantized again", source.name, e)
        return str(e)
    return model, tokenizer, combine_statuses(status, CACHE_DIRECT), done.summary()


def _quantized(model, quantize: str | None, unfit: str | None = None) -> dict | None:
    if not quantize:
        return None
    from cbgen.model.int8 import quantize_model

    done = quantize_model(model)
    if quantize == Q8_0_FILE:
        done.loader = f"dequantized by transformers, quantized again ({unfit})"
    return done.summary()
