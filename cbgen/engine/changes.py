"""What an engine scope changes outside the model, each change an object that makes itself, undoes itself, and says
whether what it changed is as it should be (cbgen.engine.scope enters them all and checks them).

A `Change` is entered into the scope's exit stack (`__enter__` installs it, `__exit__` removes it, in reverse order of
entry) and `problem()` names what is wrong with it now: while installed, that it is not in effect; after it is
removed, that it was not undone. The process-wide ones:

    logging      transformers' logging and progress bars quietened (cbgen.process.quiet, shared by every call
                 that quietens them: the first makes it, the last undoes it)
    gc           the objects that exist when the first engine starts moved into the collector's permanent
                 generation (gc.freeze), collectable again when the last one ends (gc.unfreeze): transformers
                 collects garbage twice each time a manager stops, which would scan the hundreds of thousands of
                 objects torch, transformers and the model made (0.4 s per call of a Generator on a 2-core AMD EPYC),
                 for the few cycles the manager left. Where they are frozen already (the CLI froze them once its
                 model loaded, cbgen.process.startup), nothing changes
    OpenMP       the caller's idle OpenMP pool freed while the engine waits (`CallerPool`, in cbgen.engine.openmp)

and the manager's: an attribute set for a while and put back (`Attribute`, the manager's `num_return_sequences`),
and what the step control and the KV cache change in it (`Undo`).
"""

from __future__ import annotations

import gc
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


class Quieted(Change):
    """A library's logging and progress bars quietened (cbgen.process.quiet)."""

    def __init__(self, library: str) -> None:
        super().__init__()
        self.library = library
        self.what = f"{library}'s logging quietened"

    def install(self) -> None:
        from cbgen.process.quiet import hold

        hold(self.library)

    def remove(self) -> None:
        from cbgen.process.quiet import let_go

        let_go(self.library)

    def problem(self) -> str | None:
        from cbgen.process.quiet import problem

        return problem(self.library, held=self.installed)


class _Frozen:
    """The collector's permanent generation, shared by every open scope: frozen by the first, unfrozen by the last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.before = 0  # gc.get_freeze_count() when the first holder came
        self.froze = False


_frozen = _Frozen()


class GcFrozen(Change):
    """The objects that existed when the first open scope started skipped by the cyclic collector (see the module)."""

    what = "older objects frozen (gc)"

    def install(self) -> None:
        with _frozen.lock:
            if _frozen.holders == 0:
                _frozen.before = gc.get_freeze_count()
                _frozen.froze = _frozen.before == 0
                if _frozen.froze:
                    gc.freeze()
            _frozen.holders += 1

    def remove(self) -> None:
        with _frozen.lock:
            _frozen.holders -= 1
            if _frozen.holders == 0 and _frozen.froze:
                gc.unfreeze()
                _frozen.froze = False

    def problem(self) -> str | None:
        count = gc.get_freeze_count()
        if self.installed:
            return None if count > 0 else "no object is frozen while the engine runs (something called gc.unfreeze)"
        with _frozen.lock:
            if _frozen.holders == 0 and count != _frozen.before:
                return f"{count} objects are frozen after the engines ended, {_frozen.before} were before"
        return None

