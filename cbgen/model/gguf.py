"""The converted-GGUF cache: dequantizing a GGUF checkpoint takes ~15 s for the embedded 135M model on CPU, so the
first load saves the converted model and its tokenizer as safetensors folders, and later loads read those. Processes
that ask for an entry nobody has written yet (the tasks of a Slurm array on one node) convert it once: the first holds
a lock while it converts, and the others wait for it, then read what it wrote."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.errors import first_line
from cbgen.files import file_digest, write_json_atomic
from cbgen.model import CACHE_ENV, default_cache_dir, dtype_name  # noqa: F401 (default_cache_dir: its old home)
from cbgen.model.source import ModelSource

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


CACHE_HIT = "hit"
CACHE_WRITTEN = "miss (written)"
CACHE_OFF = "off"
CACHE_UNWRITABLE = "unwritable"
CACHE_UNSUPPORTED = "unsupported"  # the weights stayed packed in GGUF blocks: no plain weights to save
CACHE_DIRECT = "not needed"  # the weights were read from the file as they are (int8: cbgen.model.q8_0)

TOKENIZER_ENTRY = "tokenizer"  # the converted tokenizer's entry; the model's is `model_entry(dtype)`
_MARKER = "cbgen-cache.json"  # written last into an entry; an entry without it is never trusted
_STALE_TEMP_SECONDS = 6 * 3600  # a temporary folder this old belongs to a killed run
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


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

    @contextmanager
    def converting(self, entry: str) -> Iterator[None]:
        """Held while this process converts `entry`: another that asks for it waits here, then finds it written.
        Where no lock can be taken (a read-only cache, a filesystem without flock) nobody waits."""
        import fcntl

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle = open(self.folder / f".lock-{entry}", "a")  # noqa: SIM115 - held for the block, closed below
        except OSError:
            yield
            return
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes, or the process dies
            except OSError:
                pass
            yield
        finally:
            handle.close()

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


def combine_statuses(*statuses: str) -> str:
    """One cache status for the run from the tokenizer's and the model's."""
    for status in (CACHE_OFF, CACHE_UNWRITABLE, CACHE_UNSUPPORTED, CACHE_WRITTEN, CACHE_DIRECT):
        if status in statuses:
            return status
    return CACHE_HIT


def load_cached(cache: GgufCache | None, entry: str, load: Callable[[Path], Any]) -> tuple[Any, str | None]:
    """(the entry loaded from the cache or None, why loading it failed or None). A failed entry is only discarded
    (by `rebuild`) once the GGUF itself has loaded: a bad setting such as --attn-implementation fails both ways,
    and must not cost the cache."""
    folder = cache.find(entry) if cache else None
    if folder is None:
        return None, None
    try:
        return load(folder), None
    except Exception as e:  # noqa: BLE001 - whatever the reason, the GGUF is loaded next
        return None, f"{type(e).__name__}: {first_line(e)}"


def rebuild(cache: GgufCache, entry: str, failure: str | None) -> None:
    """Discards an entry that failed to load where the GGUF loaded fine: it is broken (a disk error, a kill
    during a copy by hand...)."""
    if failure is not None:
        log.warning("cbgen: the cache entry '%s' is broken (%s); rebuilding it", cache.folder / entry, failure)
        cache.discard(entry)


def gguf_tokenizer(gguf: Path, cache: GgufCache | None):
    """The tokenizer inside a GGUF file, and the cache status of its converted copy."""
    from transformers import AutoTokenizer

    def load(folder: Path):
        describe_added_tokens(folder)  # entries written before cbgen did so get it once
        return AutoTokenizer.from_pretrained(folder)

    def save(folder: Path) -> None:
        tokenizer.save_pretrained(folder)
        describe_added_tokens(folder)

    tokenizer, failure = load_cached(cache, TOKENIZER_ENTRY, load)
    if tokenizer is not None:
        return tokenizer, CACHE_HIT
    if cache is None:
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), CACHE_OFF
    with cache.converting(TOKENIZER_ENTRY):
        tokenizer, failure = load_cached(cache, TOKENIZER_ENTRY, load)  # written by another process meanwhile
        if tokenizer is not None:
            return tokenizer, CACHE_HIT
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        rebuild(cache, TOKENIZER_ENTRY, failure)
        return tokenizer, CACHE_WRITTEN if cache.write(TOKENIZER_ENTRY, save) else CACHE_UNWRITABLE


def describe_added_tokens(folder: Path) -> None:
    """Writes `added_tokens_decoder` into a saved tokenizer's tokenizer_config.json. A tokenizer saved from a GGUF
    file lacks it, which sends AutoTokenizer down a path that parses all of tokenizer.json in Python (0.3 s for
    SmolLM2's); the entries are those of tokenizer.json's `added_tokens`, so what loads is the same tokenizer."""
    config_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in config or not tokenizer_path.is_file():
            return
        added = json.loads(tokenizer_path.read_text(encoding="utf-8")).get("added_tokens", [])
        config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
        write_json_atomic(config_path, config, durable=False)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # an entry that cannot be described still loads, the slow way


def model_entry(dtype: torch.dtype) -> str:
    """The cache entry that holds the converted model in `dtype` (the tokenizer's is TOKENIZER_ENTRY)."""
    return f"model-{dtype_name(dtype)}"


def load_gguf(source: ModelSource, cache: GgufCache | None, dtype: torch.dtype, **load_kwargs):
    from transformers import AutoModelForCausalLM

    gguf = source.gguf_path
    tokenizer, tokenizer_status = gguf_tokenizer(gguf, cache)
    entry = model_entry(dtype)
    def cached():
        return load_cached(cache, entry, lambda folder: AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, **load_kwargs))

    def from_gguf():
        return AutoModelForCausalLM.from_pretrained(source.location, gguf_file=source.gguf_file, dtype=dtype,
                                                    **load_kwargs)

    model, failure = cached()
    if model is not None:
        return model, tokenizer, combine_statuses(tokenizer_status, CACHE_HIT)
    if cache is None:
        return from_gguf(), tokenizer, combine_statuses(tokenizer_status, CACHE_OFF)
    with cache.converting(entry):
        model, failure = cached()  # written by another process while this one waited
        if model is not None:
            return model, tokenizer, combine_statuses(tokenizer_status, CACHE_HIT)
        model = from_gguf()
        if not drop_gguf_marker(model):
            status = CACHE_UNSUPPORTED
        else:
            rebuild(cache, entry, failure)
            status = CACHE_WRITTEN if cache.write(entry, model.save_pretrained) else CACHE_UNWRITABLE
    return model, tokenizer, combine_statuses(tokenizer_status, status)
