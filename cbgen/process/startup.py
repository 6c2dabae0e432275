"""Starting fast from the command line.

Importing torch and transformers creates some 360,000 objects, and Python's cyclic garbage collector scans them
again and again while they are created (six full collections), when transformers stops its manager (it calls
gc.collect()) and at exit: measured on a 2-core AMD EPYC, about 3.5 s of an 11.5 s one-prompt run. The CLI therefore
holds the collector off while it starts, and the job releases it once the model is loaded, after moving everything
made so far into the permanent generation (gc.freeze), which later collections skip. Library callers who never call
`hold_gc` keep their own collector settings.
"""

from __future__ import annotations

import gc

_held = False


def hold_gc() -> None:
    """No cyclic garbage collection until `release_gc` (the CLI, before anything heavy is imported)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release_gc() -> None:
    """Freezes what exists (the imported libraries and the loaded model) and turns collection back on, if
    `hold_gc` turned it off; else does nothing."""
    global _held
    if _held:
        gc.freeze()
        gc.enable()
        _held = False
