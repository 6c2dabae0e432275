"""The KV cache's memory on CPU, made resident as pages are used rather than all at start.

transformers allocates the paged cache as one `torch.zeros` tensor when the manager warms up, which writes (and so
makes resident) every byte of it: a cache sized for 128 requests of 425 prompt + 256 new tokens is 3.0 GB on SmolLM2,
resident from the first second, however few of its pages the requests fill. Memory from an anonymous mapping reads as
zeros too (the kernel guarantees it) but costs no RAM until a page is written; the cache's pool hands out its
highest free sector first and takes freed ones back last-in first-out, so the pages written stay about as many as the
requests in flight really fill. Same zeros, same tensor shape and dtype: only when the RAM is taken changes.

Only a CPU `torch.zeros` of at least `LAZY_MIN_BYTES`, called while the manager builds its cache, is served this way.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

LAZY_MIN_BYTES = 64 * 1024**2  # smaller tensors are left to torch: they are the step's buffers, not the cache


def _size(args: tuple[Any, ...]) -> tuple[int, ...] | None:
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    return tuple(shape) if all(isinstance(n, int) and n >= 0 for n in shape) else None


def mapped_zeros(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor over a fresh anonymous mapping: no RAM is taken until a page of it is written."""
    numel = math.prod(size)
    nbytes = max(numel * dtype.itemsize, 1)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor holds a reference to the mapping, which is unmapped when the last tensor over it goes
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(size)


class _LazyZeros(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.served: list[int] = []  # bytes of each tensor served lazily, for the run's record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and set(kwargs) <= {"dtype", "device"}:
            size, dtype = _size(args), kwargs.get("dtype") or torch.get_default_dtype()
            device = torch.device(kwargs.get("device") or "cpu")
            if size is not None and device.type == "cpu":
                tensor_bytes = dtype.itemsize * math.prod(size)
                if tensor_bytes >= LAZY_MIN_BYTES:
                    self.served.append(tensor_bytes)
                    return mapped_zeros(size, dtype)
        return func(*args, **kwargs)


@contextmanager
def lazy_cache_memory(device: str = "cpu") -> Iterator[list[int]]:
    """Around the manager's warm-up (where transformers builds the cache): big CPU zero tensors come from anonymous
    mappings. Yields the list of bytes served that way. On other devices it does nothing."""
    if device != "cpu":
        yield []
        return
    mode = _LazyZeros()
    with mode:
        yield mode.served
