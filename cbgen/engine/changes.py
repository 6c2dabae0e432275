"""What an engine scope changes outside the model, each a `Change` (cbgen.process.changes: it makes itself, undoes
itself, and says whether what it changed is as it should be; cbgen.engine.scope enters them all and checks them).
The process-wide ones, here:

    logging      transformers' logging and progress bars quietened (cbgen.process.quiet, shared by every call
                 that quietens them: the first makes it, the last undoes it)
    gc           the objects that exist when the first engine starts moved into the collector's permanent
                 generation (gc.freeze), collectable again when the last one ends (gc.unfreeze): transformers
                 collects garbage twice each time a manager stops, which would scan the hundreds of thousands of
                 objects torch, transformers and the model made (0.4 s per call of a Generator on a 2-core AMD EPYC),
                 for the few cycles the manager left. Where they are frozen already (the CLI froze them once its
                 model loaded, cbgen.process.startup), nothing changes
    OpenMP       the caller's idle OpenMP pool freed while the engine waits (`CallerPool`, in cbgen.engine.openmp)

and the manager's, with cbgen.process.changes' classes: an attribute set for a while and put back (`Attribute`, the
manager's `num_return_sequences`), and what the step control and the KV cache change in it (`Undo`).
"""

from __future__ import annotations

import gc
import threading

from cbgen.process.changes import Change


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

