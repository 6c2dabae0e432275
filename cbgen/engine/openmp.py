"""The generation thread's OpenMP workers alone on the CPU: the caller's idle OpenMP pool freed while an engine runs.

transformers' manager runs every forward pass in a thread of its own. The thread that loaded the model and warmed the
manager up (cbgen's main thread, or a library user's) has run OpenMP parallel regions by then, and libgomp, the OpenMP
runtime of torch's Linux wheels, keeps that thread's pool of workers docked for its next region. With more OpenMP
threads alive than CPUs, libgomp lets a waiting worker spin only briefly (its "throttled" spin count) before it
sleeps, so each of the generation thread's parallel regions first waits for its worker to be woken. Measured on a
2-core AMD EPYC Zen 4 (torch 2.13's CPU wheel): a 64 x 576 float32 multiply took 3.6 us on the main thread and 40-63 us
on another thread once the main thread had a pool; a 64 x 576 by 576 x 1536 bfloat16 matmul 310 against 380-400 us.
With the main thread's pool freed, the other thread ran both as fast as the main thread did. A decode step runs
about a thousand such operators.

`release_caller_pool()` frees the calling thread's pool with OpenMP 5's `omp_pause_resource_all`, which libgomp
implements as exactly that (the calling thread's pool, nothing of any other thread's; a region the thread runs later
builds a new pool). Where torch's OpenMP runtime is not libgomp, or has no such function, it does nothing.

The policy is the engine scope's (`CallerPool`, one of cbgen.engine.changes): while a scope is open, its engine frees
the caller's pool after starting its manager and each time it waits for results (`EngineScope.release_caller_pool`),
so a parallel region the caller runs meanwhile (reading input, writing output) costs the generation thread only until
the next wait; once the scope is closed nothing frees it any more, and the caller's next parallel region builds its
pool again. Nothing else of OpenMP's changes: torch's thread count is checked to be what it was.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

from cbgen.process.changes import Change
from cbgen.process.runtime import RUNTIME

OMP_PAUSE_SOFT = 1  # omp_pause_soft: the pool's threads end; nothing the program keeps is lost


@RUNTIME.memo("openmp pause", "libgomp's omp_pause_resource_all as torch loaded it")
@functools.lru_cache(maxsize=1)
def _pause() -> Callable[[int], int] | None:
    """libgomp's `omp_pause_resource_all`, as torch loaded it, or None."""
    try:
        import torch
    except ImportError:
        return None
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = [os.path.join(lib_dir, name) for name in sorted(os.listdir(lib_dir)) if name.startswith("libgomp")] \
        if os.path.isdir(lib_dir) else []
    candidates.append("libgomp.so.1")  # a torch built against the system's libgomp
    for path in candidates:
        try:  # only a library this process has loaded already: never load a second OpenMP runtime
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (OSError, AttributeError):
            continue
        function = getattr(library, "omp_pause_resource_all", None)
        if function is not None:
            function.argtypes = [ctypes.c_int]
            function.restype = ctypes.c_int
            return function
    return None


def release_caller_pool() -> bool:
    """Frees the calling thread's idle OpenMP pool (see the module); whether libgomp was there to do it."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


class CallerPool(Change):
    """The caller's idle OpenMP pool freed whenever the scope's engine waits, and only while the scope is open."""

    what = "the caller's idle OpenMP pool freed while the engine waits"

    def __init__(self) -> None:
        super().__init__()
        self.threads = 0  # torch.get_num_threads() on install
        self.releases = 0  # how often the pool was freed

    def install(self) -> None:
        import torch

        self.threads = torch.get_num_threads()

    def release(self) -> bool:
        """Frees the calling thread's idle pool while the scope is open (see the module); whether it was freed."""
        if not self.installed:
            return False
        self.releases += 1
        return release_caller_pool()

    def problem(self) -> str | None:
        import torch

        threads = torch.get_num_threads()
        return None if threads == self.threads else f"torch runs {threads} threads, not the {self.threads} it ran"
