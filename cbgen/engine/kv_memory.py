"""The KV cache's memory on CPU, made resident as pages are used rather than all at start.

transformers allocates the paged cache as one `torch.zeros` tensor when the manager warms up, which writes (and so
makes resident) every byte of it: a cache sized for 128 requests of 425 prompt + 256 new tokens is 3.0 GB on SmolLM2,
resident from the first second, however few of its pages the requests fill. Memory from an anonymous mapping reads as
zeros too (the kernel guarantees it) but costs no RAM until a page is written. Same zeros, same tensor shape and
dtype: only when the RAM is taken changes.

Only a CPU `torch.zeros` of at least `LAZY_MIN_BYTES`, called while the manager builds its cache, is served this way.

The pool reuses freed blocks, but not strictly last-in first-out, so over a long job the blocks ever written drift
past the blocks in use (measured on HumanEval's 164 prompts, 64 in flight: 896 MB written, about 600 MB in use). So
every block the pool takes back free (a finished request's, or a kept one evicted) is handed back to the kernel
(`MADV_DONTNEED`): its RAM goes, and the next request to get it takes pages again as it writes them. A free block's
contents are never read (attention reads only the positions a request has written), and blocks kept for sharing are
not free, so nothing a request reads changes.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

LAZY_MIN_BYTES = 64 * 1024**2  # smaller tensors are left to torch: they are the step's buffers, not the cache


def _size(args: tuple[Any, ...]) -> tuple[int, ...] | None:
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    return tuple(shape) if all(isinstance(n, int) and n >= 0 for n in shape) else None


class LazyCache:
    """The mappings served while the manager built its cache, by the address of the tensor over each."""

    def __init__(self) -> None:
        self.mappings: dict[int, mmap.mmap] = {}

    def __bool__(self) -> bool:
        return bool(self.mappings)

    def serve(self, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor over a fresh anonymous mapping: no RAM is taken until a page of it is written."""
        numel = math.prod(size)
        buffer = mmap.mmap(-1, max(numel * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # the tensor holds a reference to the mapping, which is unmapped when the last tensor over it goes
        tensor = torch.frombuffer(buffer, dtype=dtype, count=numel).view(size)
        self.mappings[tensor.data_ptr()] = buffer
        return tensor

    def return_freed_blocks(self, cache: Any) -> Callable[[], None] | None:
        """Hands back every page of `cache` (transformers' PagedAttentionCache) now, and from now on the pages of
        every block it frees into its pool; returns what undoes the latter. Called after the manager's warm-up, whose
        dummy requests may have written pages and which ends by resetting the cache: no block is in use or kept then.
        None (nothing done) when the cache is not over one of these mappings, or transformers' pool and allocators
        are not what this was written against."""
        tensor, pool = getattr(cache, "cache_tensor", None), getattr(cache, "pool", None)
        free = getattr(pool, "free_blocks", None)
        if pool is None or not isinstance(tensor, torch.Tensor) or not callable(free) \
                or not hasattr(mmap, "MADV_DONTNEED"):
            return None
        views: dict[int, torch.Tensor] = {
            allocator.index: allocator._copy_view for allocator in getattr(cache, "cache_allocators", {}).values()
            if isinstance(getattr(allocator, "_copy_view", None), torch.Tensor)}  # one row per block, in bytes
        found = self.mappings.get(tensor.data_ptr())
        if found is None or not views:
            return None
        mapping, base = found, tensor.data_ptr()
        mapping.madvise(mmap.MADV_DONTNEED)  # what the warm-up wrote

        def free_blocks(index: int, block_ids: list[int]) -> None:
            free(index, block_ids)
            view = views.get(index)
            if view is None:
                return
            for block in block_ids:
                start = view[block].data_ptr() - base  # whole pages only: a page may hold a neighbour's bytes
                first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
                end = (start + view.shape[1]) // mmap.PAGESIZE * mmap.PAGESIZE
                if end > first:
                    mapping.madvise(mmap.MADV_DONTNEED, first, end - first)

        pool.free_blocks = free_blocks

        def undo() -> None:
            if vars(pool).get("free_blocks") is free_blocks:
                del pool.free_blocks

        return undo


class _LazyZeros(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.served = LazyCache()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and set(kwargs) <= {"dtype", "device"}:
            size, dtype = _size(args), kwargs.get("dtype") or torch.get_default_dtype()
            device = torch.device(kwargs.get("device") or "cpu")
            if size is not None and device.type == "cpu":
                tensor_bytes = dtype.itemsize * math.prod(size)
                if tensor_bytes >= LAZY_MIN_BYTES:
                    return self.served.serve(size, dtype)
        return func(*args, **kwargs)


@contextmanager
def lazy_cache_memory(enabled: bool = True) -> Iterator[LazyCache]:
    """Around the manager's warm-up (where transformers builds the cache): big CPU zero tensors come from anonymous
    mappings, in this thread. Yields the LazyCache of the mappings served (empty, false, when not `enabled`: then
    nothing changes)."""
    if not enabled:
        yield LazyCache()
        return
    mode = _LazyZeros()
    with mode:
        yield mode.served
