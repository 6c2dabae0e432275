"""Changes to the process, each an object that makes itself, undoes itself, and says whether what it changed is as
it should be: entered into a scope's exit stack (`__enter__` installs it, `__exit__` removes it, in reverse order of
entry), or used on its own as a `with` block. `problem()` names what is wrong with one now: while installed, that it
is not in effect; after it is removed, that it was not undone. Every temporary change cbgen makes to the process goes
through one of these; the engine scope's own (logging quietened, the collector's frozen objects, the OpenMP pool) are
in cbgen.engine.changes and cbgen.engine.openmp.

    Undo        a change something else made already, undone by what it returned
    Attribute   an object's attribute set for a block and always put back
    Threads     torch's intra-op thread count for a block (a probe on one thread)
    Environ     environment variables set while held, shared by overlapping holders (the first sets them, the last
                puts back what was there): `TQDM_DISABLE` while the command line runs
    PathEntry   a folder put in front of PATH while held, shared likewise (the ninja package's binary while kernels
                build)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Change:
    """One change of an engine scope's: `install` makes it, `remove` undoes it, `problem` checks it (see the module)."""

    what = "a change"

    def __init__(self) -> None:
        self.installed = False

    def __enter__(self) -> Change:
        self.install()
        self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.installed = False
        self.remove()

    def install(self) -> None:
        pass

    def remove(self) -> None:
        pass

    def problem(self) -> str | None:
        """What is not as it should be (in effect while installed, undone after), or None."""
        return None


class Undo(Change):
    """A change something else made already (the step control's processors, the KV cache's page hand-back): removing
    it calls what it returned to undo it."""

    def __init__(self, what: str, undo: Callable[[], None]) -> None:
        super().__init__()
        self.what, self._undo = what, undo

    def remove(self) -> None:
        undo, self._undo = self._undo, _nothing
        undo()  # and dropped: its closure holds what it changed (a manager's processors, its cache), which must not
        # outlive the engine through the scope's record of its changes


def _nothing() -> None:
    pass


_MISSING = object()


class Attribute(Change):
    """An object's attribute, set to another value for the length of a block (`set`) and always put back: the value it
    had on install is what it holds outside such a block, and after the scope."""

    def __init__(self, target: Any, name: str) -> None:
        super().__init__()
        self.what = f"{type(target).__name__}.{name}"
        self.target, self.name = target, name
        self.before: Any = _MISSING
        self._setting: Any = _MISSING  # the value `set` gave it, while its block runs

    def install(self) -> None:
        self.before = getattr(self.target, self.name)

    def remove(self) -> None:
        setattr(self.target, self.name, self.before)

    @contextmanager
    def set(self, value: Any) -> Iterator[None]:
        if not self.installed:
            raise RuntimeError(f"{self.what} is set only inside the scope that owns it")
        self._setting = value
        setattr(self.target, self.name, value)
        try:
            yield
        finally:
            setattr(self.target, self.name, self.before)
            self._setting = _MISSING

    def problem(self) -> str | None:
        wanted = self._setting if self.installed and self._setting is not _MISSING else self.before
        now = getattr(self.target, self.name, _MISSING)
        return None if now == wanted else f"{self.what} is {now!r}, not {wanted!r}"


class Threads(Change):
    """torch's intra-op thread count set to `count` while installed, and the count before put back."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.before = 0
        self.what = f"torch's threads set to {count}"

    def install(self) -> None:
        import torch

        self.before = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def remove(self) -> None:
        import torch

        torch.set_num_threads(self.before)

    def problem(self) -> str | None:
        import torch

        wanted = self.count if self.installed else self.before
        now = torch.get_num_threads()
        return None if now == wanted else f"torch runs {now} threads, not {wanted}"


class _Holders:
    """Holders of process-wide entries (an environment variable's value, a folder on PATH), counted under one lock:
    the first holder of an entry makes it, the last one undoes it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: dict[Any, int] = {}
        self.before: dict[Any, Any] = {}  # what an entry was when its first holder came
        self.restored: dict[Any, Any] = {}  # what its last holder put back


_held = _Holders()
_UNSET = object()


class Environ(Change):
    """Environment variables set to `values` while installed; where `keep_set` is true, a variable the process had
    already is left as it was (a user's own TQDM_DISABLE=0 wins). Overlapping holders share: the first sets a
    variable, the last puts back what it had before (or unsets it); a holder that wants another value than the one
    held now is refused."""

    def __init__(self, values: dict[str, str], keep_set: bool = False) -> None:
        super().__init__()
        self.values, self.keep_set = dict(values), keep_set
        self.what = "environment " + ", ".join(f"{k}={v}" for k, v in values.items())
        self.mine: list[str] = []  # the variables this holder holds (not those it left as they were)

    def install(self) -> None:
        with _held.lock:
            mine = [name for name in self.values if not (self.keep_set and name in os.environ
                                                          and _held.count.get(("env", name), 0) == 0)]
            for name in mine:
                key = ("env", name)
                if _held.count.get(key, 0) == 0:
                    _held.before[key] = os.environ.get(name, _UNSET)
                    os.environ[name] = self.values[name]
                elif os.environ.get(name) != self.values[name]:
                    raise RuntimeError(f"{name} is held as {os.environ.get(name)!r} by another scope, "
                                       f"not {self.values[name]!r}")
                _held.count[key] = _held.count.get(key, 0) + 1
            self.mine = mine

    def remove(self) -> None:
        with _held.lock:
            for name in self.mine:
                key = ("env", name)
                _held.count[key] -= 1
                if _held.count[key] == 0:
                    before = _held.restored[key] = _held.before.pop(key)
                    if before is _UNSET:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = before

    def problem(self) -> str | None:
        with _held.lock:
            for name in self.mine:
                key = ("env", name)
                if self.installed:
                    if os.environ.get(name) != self.values[name]:
                        return f"{name} is {os.environ.get(name)!r} while held, not {self.values[name]!r}"
                elif _held.count.get(key, 0) == 0 and os.environ.get(name, _UNSET) != _held.restored.get(key, _UNSET):
                    return f"{name} is {os.environ.get(name)!r} after the scope, not what it was before"
        return None


class PathEntry(Change):
    """`folder` first on PATH while installed, shared by overlapping holders (kernel builds run in several threads):
    the first puts it there, the last takes that entry out again."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.what = f"{folder} on PATH"

    def install(self) -> None:
        key = ("path", self.folder)
        with _held.lock:
            if _held.count.get(key, 0) == 0:
                path = os.environ.get("PATH", "")
                _held.before[key] = path.split(os.pathsep).count(self.folder) if path else 0
                os.environ["PATH"] = self.folder + (os.pathsep + path if path else "")
            _held.count[key] = _held.count.get(key, 0) + 1

    def remove(self) -> None:
        key = ("path", self.folder)
        with _held.lock:
            _held.count[key] -= 1
            if _held.count[key] == 0:
                _held.restored[key] = _held.before.pop(key)
                entries = os.environ.get("PATH", "").split(os.pathsep)
                if self.folder in entries:
                    entries.remove(self.folder)  # the first: the one put in front
                    os.environ["PATH"] = os.pathsep.join(entries)

    def entries(self) -> int:
        return os.environ.get("PATH", "").split(os.pathsep).count(self.folder)

    def problem(self) -> str | None:
        key = ("path", self.folder)
        with _held.lock:
            if self.installed:
                return None if self.entries() > 0 else f"{self.folder} is not on PATH while held"
            if _held.count.get(key, 0) == 0 and key in _held.restored and self.entries() != _held.restored[key]:
                return f"PATH holds {self.folder} {self.entries()} times after the scope, {_held.restored[key]} before"
        return None
