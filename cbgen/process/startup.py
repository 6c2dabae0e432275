"""Starting fast from the command line.

Importing torch and transformers creates some 360,000 objects, and Python's cyclic garbage collector scans them
again and again while they are created (six full collections), when transformers stops its manager (it calls
gc.collect()) and at exit: measured on a 2-core AMD EPYC, about 3.5 s of an 11.5 s one-prompt run. The CLI therefore
holds the collector off while it starts, and the job releases it once the model is loaded, after moving everything
made so far into the permanent generation (gc.freeze), which later collections skip. Library callers who never call
`hold_gc` keep their own collector settings.

A command also asks torch's CPU allocator for transparent huge pages (`HUGE_PAGES`): every allocation of 2 MB or
more (weights, packed panels, activations) aligned to 2 MB and marked MADV_HUGEPAGE, so that streaming a model's
weights at each decode step costs a TLB miss every 2 MB instead of every 4 KB. torch reads the variable once, at its
first allocation, so it is set before anything is loaded; a user's own THP_MEM_ALLOC_ENABLE=0 wins, and where the
kernel's transparent huge pages are `never` it changes nothing. Measured on a 2-core AMD EPYC Zen 3 (AVX2), the
1B float32 model, processes alternated: the quick fixed workload 8.70 s -> 8.41 s (medians of 6), the full one
67.7 s -> 64.0 s (means of 2), resident memory 12.6 GB -> 12.6-13.0 GB (docs/performance.md). Library callers set it
themselves (before torch allocates) if they want it.
"""

from __future__ import annotations

import gc

_held = False

HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}  # read by torch's CPU allocator (c10) at its first allocation


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
