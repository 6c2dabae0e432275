"""LoRA adapters over the loaded base model: which a job names, what makes each the same adapter, whether it fits
the model, and its low-rank update merged into the base weights while its rows run.

A job names adapters as `--adapter PATH|HUB_ID` (the job's own: every row that names none runs with it) and
`--adapter NAME=PATH|HUB_ID` (one a row may pick by its `adapter` field, or an OpenAI batch line by its body's
`model`). An adapter is a folder as PEFT saves it: `adapter_config.json` and `adapter_model.safetensors` (or `.bin`).

**How an adapter runs: merged, one at a time, over the one copy of the base weights.** While a group of rows runs,
their adapter's update (scale * B @ A, PEFT's own arithmetic) is added into the base layers' weights in place, and
taken out after by writing back the values it replaced (an exact copy of the targeted layers, not a subtraction,
which would not give the same bits back). So the engine computes exactly what PEFT's `merge_and_unload()` model
computes, with every one of cbgen's kernels (fused layers, compiled linear blocks, batch invariance) unchanged, and
the base weights are loaded once whatever the number of adapters. The cost is a second copy of the targeted layers
while an adapter is merged, and an engine start per group of rows (cbgen.engine.adapters groups them). Weights
packed for a kernel (cbgen.model.packs) are dropped at each change, so the next engine packs the new values.

Everything here but `applied` is torch-free (it reads JSON and safetensors headers), so a job's adapters are resolved,
hashed and checked against the model (cbgen.model.adapter_fit) before any weight loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbgen.config.adapters import specs_of, split_spec
from cbgen.errors import CbgenError, first_line
from cbgen.process.runtime import RUNTIME

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
INSTALL_PEFT = "pip install 'cbgen[adapters]'"
# PEFT's weight names: base_model.model.<path>.lora_A.weight (linear), <path>.lora_embedding_A (embedding)
FACTOR = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_(embedding_)?([AB])(?:\.[^.]+)?(?:\.weight)?$")
CARRIED = re.compile(r"^(?:base_model\.model\.)?(.+)\.base_layer\.weight$")  # a copy of a base layer's own weights


@dataclass(frozen=True)
class Adapter:
    """One adapter: the name rows know it by, what was given, its local folder and its adapter_config.json."""

    name: str
    spec: str  # the path or hub id as given
    folder: Path
    config: dict[str, Any] = field(hash=False, compare=False)

    @property
    def weights(self) -> Path:
        return next(self.folder / name for name in WEIGHT_FILES if (self.folder / name).is_file())

    def identity(self, memo: Path | None = None) -> dict[str, Any]:
        """What makes it the same adapter for a resume and the result cache: its weights and config by content
        (the weights hashed once and remembered by size and mtime in `memo`)."""
        from cbgen.files import file_digest

        return {"config_sha256": hashlib.sha256((self.folder / CONFIG_FILE).read_bytes()).hexdigest(),
                "weights_sha256": file_digest(self.weights, memo)}

    def describe(self) -> dict[str, Any]:
        """run.json's and the dataset card's account of it."""
        c = self.config
        targets = c.get("target_modules")
        return {"name": self.name, "source": self.spec, "peft_type": c.get("peft_type"), "r": c.get("r"),
                "lora_alpha": c.get("lora_alpha"), "target_modules": sorted(targets) if isinstance(targets, list)
                else targets, "base_model": c.get("base_model_name_or_path")}


@dataclass(frozen=True)
class Adapters:
    """A job's adapters: `default` runs the rows that name none (None: the base model), `named` those rows pick."""

    default: Adapter | None
    named: dict[str, Adapter] = field(hash=False)

    @property
    def all(self) -> list[Adapter]:
        """Each distinct adapter once: the default first."""
        found = {a.name: a for a in ([self.default] if self.default else []) + list(self.named.values())}
        return list(found.values())

    def pick(self, name: str | None) -> Adapter | None:
        """The adapter a row's `adapter` field names (None: the job's default). Raises KeyError for another name."""
        if name is None:
            return self.default
        if name in self.named:
            return self.named[name]
        if self.default is not None and name == self.default.name:
            return self.default
        raise KeyError(name)

    def names(self) -> list[str]:
        return [a.name for a in self.all]

    def identity(self, memo: Path | None = None) -> dict[str, Any]:
        """Which runs the rows that name none, and each adapter's identity by its name."""
        return {"default": self.default.name if self.default else None,
                "by_name": {a.name: a.identity(memo) for a in self.all}}


def resolve(specs: list[str], where: str = "--adapter") -> Adapters | None:
    """The job's adapters, each found on disk (a folder, or a hub id from the hub or its local cache) and its config
    read; None when it names none. Raises CbgenError naming the adapter and the way out.

    Resolved once: every part of a job that asks (its engine, the result cache, the resume fingerprint, run.json, the
    card) gets the same table, and a hub id is looked up once per process. The table is made again only when an
    adapter's files change (their sizes and modification times), so a resume still sees new weights."""
    if not specs:
        return None
    folders = [(spec, name, location, _folder(location, where))
               for spec in specs for name, location in [split_spec(spec)]]
    key = (where, tuple((spec, str(folder), _files_state(folder)) for spec, _, _, folder in folders))
    with _resolved.lock:
        known = _resolved.get(key)
    if known is None:
        known = _table(folders, where)
        with _resolved.lock:
            _resolved[key] = known
    return known


_resolved = RUNTIME.cache("adapters resolved", "(specs, their files' sizes and mtimes) -> the job's adapter table")
_hub_folders = RUNTIME.cache("adapter hub folders", "hub id -> its snapshot folder, looked up once per process")


def _files_state(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when an adapter's files do: each one's name, size and modification time."""
    state = []
    for name in (CONFIG_FILE, *WEIGHT_FILES):
        try:
            info = (folder / name).stat()
        except OSError:
            continue
        state.append((name, info.st_size, info.st_mtime_ns))
    return tuple(state)


def _table(folders: list[tuple[str, str | None, str, Path]], where: str) -> Adapters:
    default = None
    named: dict[str, Adapter] = {}
    for _spec, name, location, folder in folders:
        adapter = Adapter(name or default_name(location), location, folder, _read_config(folder, where, location))
        if name is None:
            default = adapter
        else:
            named[name] = _one_per_name(named.get(name), adapter, where)
    if default is not None:
        _one_per_name(named.get(default.name), default, where, own=True)
    return Adapters(default, named)


def _one_per_name(known: Adapter | None, adapter: Adapter, where: str, own: bool = False) -> Adapter:
    """`adapter`, unless another adapter already has its name: then rows, the result cache, a resume and run.json
    could each take one for the other, so the job is refused (the same folder named twice is one adapter)."""
    if known is None or known.folder.resolve() == adapter.folder.resolve():
        return adapter
    this = f"{adapter.spec} (the job's own, named after its folder)" if own else f"{adapter.name}={adapter.spec}"
    raise CbgenError(f"{where}: two adapters are called {adapter.name!r}: {known.name}={known.spec} and {this}; give "
                     "each its own name (NAME=PATH)")


def section_adapters(settings: Any) -> Adapters | None:
    """The adapters model settings (cbgen.config.ModelSection) name in `adapter`, resolved; None: none."""
    return resolve(specs_of(settings.adapter))


def job_adapters(job: Any) -> Adapters | None:
    """The adapters a job (cbgen.config.JobConfig) names in its `model.adapter` setting, resolved; None: none."""
    return section_adapters(job.model)


def default_name(location: str) -> str:
    """The job's own adapter is named by its folder (or hub id)'s last part, as run.json and the rows show it."""
    return Path(location.rstrip("/")).name or location


def _folder(location: str, where: str) -> Path:
    path = Path(location).expanduser()
    if path.is_dir():
        return path.absolute()  # the same folder from a worker or stage that runs in another directory
    if path.exists():
        raise CbgenError(f"{where} {location}: not a folder; give the folder PEFT saved the adapter in (it holds "
                         f"{CONFIG_FILE})")
    looks_local = location.startswith((".", "/", "~")) or location.count("/") != 1
    if not looks_local:
        if location in _hub_folders:
            return _hub_folders[location]
        try:
            from huggingface_hub import snapshot_download

            offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
            folder = _hub_folders[location] = Path(snapshot_download(location, local_files_only=offline))
            return folder
        except Exception as e:  # noqa: BLE001 - unknown repo, no network, offline and not cached: one line
            raise CbgenError(f"{where} {location}: no such folder, and not a hub adapter found ({first_line(e)}); "
                             "give the folder PEFT saved the adapter in") from None
    raise CbgenError(f"{where} {location}: no such folder; give the folder PEFT saved the adapter in (it holds "
                     f"{CONFIG_FILE} and {WEIGHT_FILES[0]})")


def _read_config(folder: Path, where: str, location: str) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except OSError:
        raise CbgenError(f"{where} {location}: no {CONFIG_FILE} in {folder}; is it a PEFT adapter folder?") from None
    except ValueError as e:
        raise CbgenError(f"{where} {location}: {CONFIG_FILE} is not JSON ({first_line(e)})") from None
    if not isinstance(config, dict):
        raise CbgenError(f"{where} {location}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise CbgenError(f"{where} {location}: a {config.get('peft_type')!r} adapter; cbgen runs LoRA adapters "
                         "(peft_type LORA)")
    saved = config.get("modules_to_save") or config.get("trainable_token_indices")
    if saved:
        raise CbgenError(f"{where} {location}: the adapter also replaces whole modules or token rows ({saved}); cbgen "
                         "merges low-rank updates only: merge it into the model with PEFT's merge_and_unload(), save "
                         "that, and run it with --model")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise CbgenError(f"{where} {location}: no {' or '.join(WEIGHT_FILES)} in {folder}")
    return config


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from a safetensors file's header alone (no tensor is read)."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def adapted_paths(adapter: Adapter) -> list[str]:
    """The module paths the adapter's weight file touches (its factors' layers and any base layer it carries a copy
    of), from the safetensors header; [] for a pickled file (read by PEFT alone)."""
    if adapter.weights.suffix != ".safetensors":
        return []
    try:
        names = safetensors_shapes(adapter.weights)
    except (OSError, ValueError, struct.error):
        return []  # unreadable: PEFT's load says why
    return sorted({m.group(1) for name in names if (m := FACTOR.match(name) or CARRIED.match(name))})


# -- merged ---------------------------------------------------------------------------------------------------------


@contextmanager
def applied(model: Any, adapter: Adapter | None) -> Iterator[None]:
    """`adapter`'s update merged into `model`'s weights while the block runs, by PEFT's own merge (so its bits are
    `merge_and_unload()`'s), in place: the model keeps its modules and every tensor its storage (a fused layer's views
    included). On exit each targeted layer's weights are written back as they were, bit for bit. None: the block runs
    on the base model."""
    with weights_held(model):
        if adapter is None:
            yield
            return
        try:
            from peft import PeftModel
            from peft.tuners.lora import LoraLayer
        except ImportError:
            raise CbgenError(f"--adapter {adapter.spec}: adapters need PEFT, which is not installed: run "
                             f"`{INSTALL_PEFT}`") from None
        import torch

        from cbgen.model import packs

        # the layers its file names are saved before PEFT loads it: an adapter of an embedding carries a copy of
        # the embedding's own weights, which PEFT's load writes over the model's
        modules = dict(model.named_modules())
        saved = [entry for path in adapted_paths(adapter) if path in modules for entry in _saved(modules[path])]
        loaded_over = list(saved)
        try:
            with torch.no_grad():
                wrapped = PeftModel.from_pretrained(model, str(adapter.folder), is_trainable=False)
                known = {(id(entry.module), entry.name) for entry in saved}
                for module in wrapped.modules():
                    if isinstance(module, LoraLayer):
                        saved += [e for e in _saved(module.get_base_layer()) if (id(e.module), e.name) not in known]
                for entry in loaded_over:
                    if not torch.equal(getattr(entry.module, entry.name), entry.before):
                        raise CbgenError(f"--adapter {adapter.spec}: it carries its own copy of a layer's weights, "
                                         "and they are not this model's (made for another base model, or a resized "
                                         "vocabulary): run it on its base model")
                wrapped.merge_and_unload()
                for entry in saved:
                    entry.keep_storage()
        except BaseException as e:  # whatever stopped it (a pickled file, a config value, Ctrl-C): the base comes back
            _restore(saved)
            _strip(model, LoraLayer)
            packs.clear()
            if not isinstance(e, Exception) or isinstance(e, CbgenError):
                raise
            raise CbgenError(f"--adapter {adapter.spec}: cannot be merged into the model: {type(e).__name__}: "
                             f"{first_line(e)}") from None
        packs.clear()  # packed for the values before: the next engine packs the merged ones
        try:
            yield
        finally:
            _restore(saved)
            packs.clear()


@dataclass
class _Saved:
    """One targeted tensor of a base layer: the storage it had (which views, a fused layer's, share) and its values
    before the merge."""

    module: Any
    name: str
    storage: Any  # the tensor's `.data` before the merge
    before: Any  # a copy of its values

    def keep_storage(self) -> None:
        """PEFT's plain merge adds in place (`weight.data += delta`); where a merge gave the layer a new tensor (its
        safe path, some variants), the merged values go into the old storage, and the layer takes it back."""
        current = getattr(self.module, self.name).data
        if current.data_ptr() != self.storage.data_ptr():
            self.storage.copy_(current)
            getattr(self.module, self.name).data = self.storage


def _saved(layer: Any) -> list[_Saved]:
    """A layer's weight and bias as they are now."""
    return [_Saved(layer, name, tensor.data, tensor.detach().clone())
            for name in ("weight", "bias") if (tensor := getattr(layer, name, None)) is not None]


def _strip(model: Any, lora_layer: Any) -> None:
    """Each layer PEFT wrapped before it failed is the model's own layer again."""
    for name, module in list(model.named_modules()):
        if isinstance(module, lora_layer) and name:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    for attribute in ("peft_config", "_hf_peft_config_loaded"):
        if attribute in vars(model):
            delattr(model, attribute)


def _restore(saved: list[_Saved]) -> None:
    import torch

    with torch.no_grad():
        for entry in saved:
            entry.keep_storage()
            entry.storage.copy_(entry.before)


_held_lock = threading.Lock()
_held: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()  # model -> [thread, depth]


@contextmanager
def weights_held(model: Any) -> Iterator[None]:
    """The model's weights held by this thread while the block runs (an adapter merged into them, or a run of the
    base model): another thread that asks meanwhile is refused at once, before it touches them, since a merge
    changes the weights every engine on the model computes with. The thread holding them may ask again."""
    me = threading.get_ident()
    with _held_lock:
        entry = _held.get(model)
        if entry is not None and entry[0] != me:
            raise CbgenError(f"this model is already generating in another engine (thread {entry[2]!r}); one model "
                             "runs one engine at a time: give each thread its own cbgen.Generator")
        if entry is None:
            entry = _held[model] = [me, 0, threading.current_thread().name]
        entry[1] += 1
    try:
        yield
    finally:
        with _held_lock:
            entry[1] -= 1
            if entry[1] == 0 and _held.get(model) is entry:
                del _held[model]
