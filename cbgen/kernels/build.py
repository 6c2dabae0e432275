"""cbgen's compiled CPU kernels, built on first use and cached: one C++ source per kernel, compiled with
`torch.utils.cpp_extension` into a folder of cbgen's cache named by what the binary depends on (the source's hash,
torch's version and the CPU capability torch dispatches to), then loaded into torch's operator registry.

A warm start loads the cached library directly (no compiler, no ninja); a cold one compiles it (about 30-40 s on 2
cores), while other processes asking for the same build wait on torch's lock in the build folder and then load it.
A job says so before it waits (`uncached`). The cache folders cbgen makes are its user's alone (mode 0700), and a
library in a folder another user owns or can write is never loaded: it is built again in a private folder.
Where nothing can be built (no compiler, a read-only cache, a failed build) the kernel is unavailable, with the
reason, and callers keep transformers' or cbgen's eager path.

The vector code is ATen's `at::vec`, compiled for the capability torch itself dispatches to on this machine
(`torch.backends.cpu.get_cpu_capability()`, which honours `ATEN_CPU_CAPABILITY`), never `-march=native`: a cache
folder shared by machines of several kinds (a cluster's home directory) holds one build per capability.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from cbgen.process.changes import PathEntry
from cbgen.process.runtime import RUNTIME

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = {"paged_attention": _HERE / "paged_attention.cpp", "decoder_ops": _HERE / "decoder_ops.cpp",
           "linear_tiles": _HERE / "linear_tiles.cpp", "sampling": _HERE / "sampling.cpp",
           "packed_attention": _HERE / "packed_attention.cpp", "int8_linear": _HERE / "int8_linear.cpp"}
# the kernels a generation job uses: building one of them starts the builds of the others beside it
GENERATION = ("paged_attention", "decoder_ops", "linear_tiles", "sampling")

# Compiler flags per torch CPU capability: those torch builds its own kernels of that capability with
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
# -fopenmp: ATen's parallel_for is inline OpenMP code (without it the kernel runs on one thread); the library then
# links libgomp.so.1, which resolves to the copy torch has already loaded. -ffp-contract=off: the arithmetic is the
# source's (its explicit fmadd calls), never a multiply and an add the compiler fused in one place and not another
_COMMON_FLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
_DONE = "cbgen-built"  # written into the build folder once the library loaded after its build
DISABLE_ENV = "CBGEN_NO_KERNELS"  # set to 1: never build or load a compiled kernel (cbgen's eager paths run)


@dataclass(frozen=True)
class Built:
    """A kernel's state in this process: loaded (with where from, and how long the build or load took) or not, and
    why not."""

    name: str
    loaded: bool
    detail: str  # "built in N s", "cached", or why it is unavailable
    seconds: float = 0.0
    library: Path | None = None


_builds = RUNTIME.cache("kernel builds", "kernel name -> its build or load in this process (a Future of Built)")
_logged = RUNTIME.cache("kernel states said", "kernel name -> the state the log said it is in")


def capability() -> str:
    """The CPU capability torch dispatches its own kernels to here (AVX512, AVX2, DEFAULT, ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def _flags(cap: str) -> list[str]:
    return _COMMON_FLAGS + _CAPABILITY_FLAGS.get(cap, ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"])


def build_key(name: str) -> str:
    """What the binary depends on, hashed: its source, the flags, torch's version and the CPU capability."""
    import torch

    cap = capability()
    digest = hashlib.sha256(SOURCES[name].read_bytes())
    digest.update("\0".join([torch.__version__, cap, *_flags(cap)]).encode())
    return f"{cap.lower()}-{digest.hexdigest()[:16]}"


def build_folder(name: str) -> Path:
    from cbgen.cache_root import kernel_cache_dir

    return kernel_cache_dir() / f"{name}-{build_key(name)}"


def _module_name(name: str) -> str:
    return f"cbgen_{name}_{build_key(name).replace('-', '_')}"


def _compile(name: str, folder: Path) -> Path:
    """Compiles the kernel into `folder` (torch's lock there makes a second process wait) and returns the library."""
    from torch.utils import cpp_extension

    cap = capability()
    with _ninja_on_path():
        library = cpp_extension.load(name=_module_name(name), sources=[str(SOURCES[name])], extra_cflags=_flags(cap),
                                     extra_ldflags=["-fopenmp"],
                                     build_directory=str(folder), is_python_module=False, verbose=False)
    return Path(str(library))


def _ninja_on_path() -> AbstractContextManager[object]:
    """The ninja package's binary first on PATH while a build runs (torch runs `ninja` by name; the package's folder
    is not on PATH where its environment's bin is not), taken off again after the last build in flight; nothing
    where the package is not installed (torch then says ninja is missing, and the kernel is unavailable)."""
    try:
        import ninja
    except ImportError:
        return nullcontext()
    return PathEntry(ninja.BIN_DIR)


def unsafe_reason(path: Path) -> str | None:
    """Why a library in `path` (a file, and each folder above it up to the filesystem's root) could have been put
    or changed there by another user, or None: each must be this user's (or root's) and writable by no one else.
    A shared cache folder anyone can write would otherwise run their code in every job that loads from it."""
    me = os.getuid()
    for part in [path, *path.parents]:
        try:
            info = part.stat()
        except OSError:
            continue
        sticky_root = part == Path("/tmp") or bool(info.st_mode & 0o1000)  # /tmp-like: only owners replace entries
        if info.st_uid not in (me, 0):
            return f"{part} belongs to another user (uid {info.st_uid})"
        if info.st_mode & 0o022 and not (sticky_root and part != path):
            return f"{part} can be written by other users (mode {oct(info.st_mode & 0o777)})"
    return None


def _private_folder(name: str) -> Path:
    """A fresh folder only this user can enter, for a build that must not come from (or go to) a shared cache."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"cbgen-kernel-{name}-"))


def _load(name: str) -> Built:
    import torch

    if os.environ.get(DISABLE_ENV) == "1":
        return Built(name, False, f"compiled kernels are off ({DISABLE_ENV}=1)")
    try:
        folder = build_folder(name)
    except Exception as e:  # noqa: BLE001 - no cache folder: say why, run the eager path
        return Built(name, False, f"no cache folder for the build: {e}")
    library = folder / f"{_module_name(name)}.so"
    start = time.perf_counter()
    unsafe = unsafe_reason(library) if library.exists() else None
    if unsafe is not None:  # never loaded: built again where only this user can write
        log.warning("not loading cbgen's cached kernel %s: %s; building it in a private folder", library, unsafe)
        folder = _private_folder(name)
    elif (folder / _DONE).exists() and library.exists():
        try:
            torch.ops.load_library(str(library))
            return Built(name, True, "cached", time.perf_counter() - start, library)
        except Exception as e:  # noqa: BLE001 - a broken cached library: build it again below
            log.info("cached kernel %s did not load (%s); building it again", library, e)
    try:
        _private_mkdir(folder)
        if (unsafe := unsafe_reason(folder)) is not None:
            log.warning("not building cbgen's kernel %s in %s: %s; building it in a private folder", name, folder,
                        unsafe)
            folder = _private_folder(name)
        library = _compile(name, folder)
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build, an unwritable cache: the eager path runs
        reason = str(e).strip().splitlines()
        return Built(name, False, f"the build failed: {reason[-1] if reason else type(e).__name__}")
    seconds = time.perf_counter() - start
    try:
        (folder / _DONE).write_text(f"{seconds:.1f}\n")
    except OSError:
        pass
    return Built(name, True, f"built in {seconds:.1f} s", seconds, library)


def _private_mkdir(folder: Path) -> None:
    """`folder` and the folders above it that it makes, each only its user's (mode 0700)."""
    missing = [part for part in [folder, *folder.parents] if not part.exists()]
    for part in reversed(missing):
        part.mkdir(mode=0o700, exist_ok=True)


def uncached(names: tuple[str, ...] = GENERATION) -> list[str]:
    """The kernels of `names` that would be compiled now (not in the cache, and kernels not turned off)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return []
    with _builds.lock:
        started = set(_builds)
    return [name for name in names if name not in started and not _cached(name)]


def build_notice() -> str | None:
    """What a job says before it builds the generation kernels (once per machine), or None when they are cached."""
    pending = uncached(GENERATION)
    if not pending:
        return None
    from cbgen.cache_root import kernel_cache_dir

    return (f"rendering prompts, and building cbgen's compiled CPU kernels ({', '.join(pending)}): once per machine, "
            f"about a minute on 2 cores; later jobs load them from {kernel_cache_dir()}")


def _cached(name: str) -> bool:
    """Whether the kernel's build is in the cache already (a warm start loads it, compiling nothing)."""
    try:
        folder = build_folder(name)
    except Exception:  # noqa: BLE001 - no cache folder: _load says why
        return False
    return (folder / _DONE).exists() and (folder / f"{_module_name(name)}.so").exists()


def kernel(name: str) -> Built:
    """The kernel `name` loaded into `torch.ops.cbgen_kernels` (built first if needed), or why it is not. Done once
    per process; later calls return the first answer. A generation kernel's build starts the builds of the other
    generation kernels not in the cache beside it (a job uses them all, and each is one compiler process: on 2 cores
    two builds take about as long as one); an encoder's kernel is built alone."""
    with _builds.lock:
        future = _builds.get(name)
        if future is None:
            others = [] if name not in GENERATION or _cached(name) or os.environ.get(DISABLE_ENV) == "1" else \
                [other for other in GENERATION if other not in _builds and not _cached(other)]
            for wanted in (name, *(other for other in others if other != name)):
                _builds[wanted] = _pool().submit(_load, wanted)
            future = _builds[name]
    state = future.result()
    with _logged.lock:
        if _logged.get(name) != state:
            _logged[name] = state
            if state.loaded:
                log.info("compiled kernel %s: %s", name, state.detail)
            else:
                log.warning("compiled kernel %s unavailable: %s", name, state.detail)
    return state


_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=len(SOURCES), thread_name_prefix="cbgen-kernel-build")
    return _executor
