"""Reading a GGUF file once per load: transformers' GGUF loader parses the whole file for the tokenizer, again for
the config and again for the weights (its metadata holds the tokenizer's 49,152 tokens and merges for SmolLM2: 7 s a
parse on a 2-core AMD EPYC Zen 3), and builds the gguf package's tensor-name map once per module it visits (397 maps
for SmolLM2, 7 s). While `parsed_once()` is held (cbgen.model.gguf holds it around a conversion), each file is parsed
once (keyed by its path, size and modification time: the reader only maps the file, read-only) and each map is built
once per architecture and layer count; both are forgotten when the last holder leaves. The results are what
transformers' own calls return (the same reader, the same map), so what loads is unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cbgen.process.runtime import RUNTIME
from cbgen.process.shared_patch import SharedPatch

_readers = RUNTIME.cache("gguf readers", "(path, size, mtime) -> the gguf package's reader, while a load holds it")
_maps = RUNTIME.cache("gguf name maps", "(architecture, layers) -> the gguf package's name map, while a load holds it")


def _gguf() -> Any:
    import gguf

    return gguf


def _reader(path: Any, *args: Any, **kwargs: Any) -> Any:
    """gguf.GGUFReader(path), one per file (the original's for any other call)."""
    original = _READER.original
    if args or kwargs:
        return original(path, *args, **kwargs)
    try:
        info = os.stat(path)
    except OSError:
        return original(path)
    key = (os.path.realpath(path), info.st_size, info.st_mtime_ns)
    with _readers.lock:
        found = _readers.get(key)
    if found is None:
        found = original(path)
        with _readers.lock:
            found = _readers.setdefault(key, found)
    return found


def _name_map(arch: Any, n_blocks: int) -> Any:
    """gguf.get_tensor_name_map(arch, n_blocks), one per architecture and layer count."""
    key = (arch, n_blocks)
    with _maps.lock:
        found = _maps.get(key)
    if found is None:
        found = _NAME_MAP.original(arch, n_blocks)
        with _maps.lock:
            found = _maps.setdefault(key, found)
    return found


_READER = SharedPatch("gguf.GGUFReader", lambda: _gguf().GGUFReader,
                      lambda value: setattr(_gguf(), "GGUFReader", value), _reader)
_NAME_MAP = SharedPatch("gguf.get_tensor_name_map", lambda: _gguf().get_tensor_name_map,
                        lambda value: setattr(_gguf(), "get_tensor_name_map", value), _name_map)


@contextmanager
def parsed_once() -> Iterator[None]:
    """While the block runs, transformers' GGUF loader parses each file once and builds each name map once."""
    _READER.hold()
    _NAME_MAP.hold()
    try:
        yield
    finally:
        _NAME_MAP.release()
        _READER.release()
        with _readers.lock:
            if not _READER.holders:
                _readers.clear()
                _maps.clear()


def forget(path: Any) -> None:
    """Drops the file's parsed reader (held loads parse it again if they ask): its objects are freed once the caller
    holds none of them."""
    real = os.path.realpath(path)
    with _readers.lock:
        for key in [key for key in _readers if key[0] == real]:
            del _readers[key]
