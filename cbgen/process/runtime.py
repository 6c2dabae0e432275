"""The process's caches, owned in one place: every room that keeps something for the rest of the process (packed
weights, kernel builds, probes of what this machine computes, parsed GGUF files, resolved adapters) asks `RUNTIME`
for it by name instead of holding a module-level dict of its own, so that one object can say what the process holds
(`sizes`) and forget it (`clear`): a long-lived program (the API server, a notebook) that changed what a cache was
built from (weights changed through `.data`, a kernel folder removed, an adapter rewritten in place), and the tests,
each of which starts from a fresh process's state.

Two kinds of entry:

    Cache   a mapping and its lock (`RUNTIME.cache(name, what)`): the room reads and writes it under `cache.lock`
    memo    a function cached with functools (`RUNTIME.memo(name, what)` on top of `functools.lru_cache`): a probe
            whose answer holds for the process

What is held while an engine runs (patched registries, a model's weights held by its scope) is no cache: the scope
that made it undoes it (cbgen.process.changes), and `clear` leaves it alone. Where the process keeps files (the
cache folder and the kernels' folder) is decided in cbgen.cache_root; `folders()` reports it beside the caches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
F = TypeVar("F", bound=Callable[..., Any])


class Cache(MutableMapping[K, V], Generic[K, V]):
    """A named mapping of the process's, with the lock its writers take (`store`: the mapping it keeps, a dict unless
    given, e.g. one keyed weakly by tensors)."""

    def __init__(self, name: str, what: str, store: MutableMapping[K, V] | None = None) -> None:
        self.name, self.what = name, what
        self.lock = threading.RLock()
        self._store: MutableMapping[K, V] = {} if store is None else store

    def __getitem__(self, key: K) -> V:
        return self._store[key]

    def __setitem__(self, key: K, value: V) -> None:
        self._store[key] = value

    def __delitem__(self, key: K) -> None:
        del self._store[key]

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._store))

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        with self.lock:
            self._store.clear()


class Runtime:
    """Every cache of the process, by name (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[str, Cache[Any, Any]] = {}
        self._memos: dict[str, tuple[str, Any]] = {}

    def cache(self, name: str, what: str, store: MutableMapping[Any, Any] | None = None) -> Cache[Any, Any]:
        """The process's cache `name` (made on the first call; a name is one room's: a second room asking for it
        with another description is a mistake in cbgen, refused)."""
        with self._lock:
            known = self._caches.get(name)
            if known is None:
                known = self._caches[name] = Cache(name, what, store)
            elif known.what != what:
                raise ValueError(f"the process cache {name!r} is {known.what!r} already, not {what!r}")
            return known

    def named(self, name: str) -> Cache[Any, Any]:
        """The cache `name`, made already by the room that owns it."""
        with self._lock:
            return self._caches[name]

    def memo(self, name: str, what: str) -> Callable[[F], F]:
        """Registers a function already cached by functools (it has `cache_clear` and `cache_info`) under `name`."""

        def register(function: F) -> F:
            if not hasattr(function, "cache_clear"):
                raise TypeError(f"{name}: {function!r} is not cached by functools")
            with self._lock:
                self._memos[name] = (what, function)
            return function

        return register

    def names(self) -> dict[str, str]:
        """Every cache's and memo's name, with what it holds."""
        with self._lock:
            return {name: cache.what for name, cache in self._caches.items()} | \
                {name: what for name, (what, _) in self._memos.items()}

    def sizes(self) -> dict[str, int]:
        """How many entries each cache and memo holds now."""
        with self._lock:
            caches, memos = dict(self._caches), dict(self._memos)
        sizes = {name: len(cache) for name, cache in caches.items()}
        return sizes | {name: function.cache_info().currsize for name, (_, function) in memos.items()}

    def clear(self, *names: str) -> list[str]:
        """Forgets what the caches `names` hold (all of them where none is named) and returns the names cleared; a
        name the process has no cache of is refused (ValueError), naming those it has."""
        with self._lock:
            caches, memos = dict(self._caches), dict(self._memos)
        unknown = [name for name in names if name not in caches and name not in memos]
        if unknown:
            known = ", ".join(sorted([*caches, *memos]))
            raise ValueError(f"no process cache named {', '.join(unknown)}; there are: {known}")
        chosen = list(names) or [*caches, *memos]
        for name in chosen:
            if name in caches:
                caches[name].clear()
            else:
                memos[name][1].cache_clear()
        return chosen

    @staticmethod
    def folders() -> dict[str, Path]:
        """Where the process keeps files: the cache folder and the compiled kernels' folder (cbgen.cache_root)."""
        from cbgen.cache_root import default_cache_dir, kernel_cache_dir

        return {"cache": default_cache_dir(), "kernels": kernel_cache_dir()}


RUNTIME = Runtime()
