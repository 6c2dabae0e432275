"""Batch-invariant linear layers as cbgen's compiled kernel (cbgen/kernels/linear_tiles.cpp): each output block of
64 rows x a panel's columns (`block_n`) computed by one thread with oneDNN's brgemm micro-kernel, its reduction added
in a fixed order (float32: 64 KiB of the panel a call, chunk after chunk), so a row's bits are its own whatever shares
the call and however many threads run (the source says why), with no padded tiles.

Where it serves (`unfit_reason`): float32 on a CPU with AVX2 or AVX-512, bfloat16 on one with bfloat16 units (AMX, or
AVX-512 BF16), in a torch with oneDNN; anywhere else ATen's micro-kernel call would be a BLAS call, whose bits move
with the shape, and the layers run cbgen.model.invariant's fixed tiles instead. Planning decides
(cbgen.engine.setup.linear_kernel_choice) and run.json says which ran and why.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from cbgen.model import packs

KERNEL = "linear_tiles"
BLOCK_N = 64  # output columns a micro-kernel call computes: the panels the weight is packed in
BLOCK_N_AVX2_FLOAT32 = 32  # narrower panels where float32 runs on AVX2 (see block_n)
# oneDNN's ISA names under which its micro-kernel does not serve float32 (needs AVX2) or bfloat16 (needs AVX-512)
_BELOW_AVX2 = ("SSE41", "AVX")
_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def unfit_reason(dtype: torch.dtype) -> str | None:
    """Why the compiled linear tiles cannot serve layers in `dtype` on this machine, or None."""
    from cbgen.config.cpu import cpu_row

    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return "this torch runs without oneDNN, whose micro-kernel the kernel calls"
    capability = str(torch.backends.cpu.get_cpu_capability())
    limit = next((os.environ[name].upper() for name in _ISA_ENV if os.environ.get(name)), "ALL")
    if dtype == torch.float32:
        if capability not in ("AVX2", "AVX512") or limit in _BELOW_AVX2:
            return f"float32 needs AVX2 or AVX-512 (torch runs {capability} kernels here, oneDNN up to {limit})"
    elif dtype == torch.bfloat16:
        if capability != "AVX512" or cpu_row().dtype != "bfloat16" or limit in (*_BELOW_AVX2, "AVX2") or \
                limit.startswith("AVX2_"):
            return "bfloat16 needs a CPU with bfloat16 units (AMX or AVX-512 BF16)"
    else:
        return f"the kernel computes float32 and bfloat16, and the model runs in {str(dtype).removeprefix('torch.')}"
    return None


def block_n(dtype: torch.dtype) -> int:
    """Output columns per packed panel for layers in `dtype` here: 32 in float32 where torch runs AVX2 kernels
    (faster than 64 there, end to end: docs/performance.md, the constants), 64 elsewhere (AVX-512 and AMX, not
    measured at 32). The kernel reads the width from the packed weight."""
    if dtype == torch.float32 and str(torch.backends.cpu.get_cpu_capability()) == "AVX2":
        return BLOCK_N_AVX2_FLOAT32
    return BLOCK_N


def layer_fits(module: torch.nn.Linear) -> bool:
    """Whether one layer's weight is one the kernel packs: float32, or bfloat16 with an even number of inputs."""
    weight = module.weight
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)


def tiled_forward(ops: Any, module: torch.nn.Linear) -> functools.partial:
    """The layer's forward through the kernel, over its weight packed once for the loaded model (cbgen.model.packs:
    a second copy of it, kept while the weight lives and unchanged)."""
    width = block_n(module.weight.dtype)
    packed = packs.kept(module.weight, f"{KERNEL}/{width}",
                        lambda w: ops.linear_pack(w.detach().contiguous(), width))
    bias = None if module.bias is None else packs.kept(  # added to the float32 sums
        module.bias, "float32", lambda b: b.detach().float().contiguous())
    return functools.partial(_forward, ops, module, packed, bias)


def _forward(ops: Any, module: torch.nn.Linear, packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
             ) -> torch.Tensor:
    if torch.is_grad_enabled() or x.dtype != module.weight.dtype or x.device.type != "cpu":
        return torch.nn.functional.linear(x, module.weight, module.bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = ops.linear_tiles(rows, packed, bias, module.out_features)
    return out.view(*x.shape[:-1], module.out_features)
