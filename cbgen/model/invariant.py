"""Batch-invariant linear layers: every matmul of the model's forward pass in fixed-shape row tiles, so that a row's
result does not depend on how many rows share the call, where it sits among them, or how many threads run it.

**Why.** A BLAS picks its kernel, its blocking and its thread split by the shape of the call. Under continuous
batching a token's row shares each linear layer with every other token of the step, so the same prompt gives other
logits in another batch. Measured on a 2-core Intel Xeon (Sapphire Rapids, AMX), torch 2.13's CPU wheel
(benchmarks/batch_invariance.py): in bfloat16 the MLP up projection (1536 x 576) and the vocabulary projection
(49,152 x 576) of the embedded model give a row other bits when the row count or the row's place changes; in float32
every shape does, and the MLP down projection (576 x 1536) also changes with the thread count (1 against 2), which
is what a `--data-parallel` replica runs with.

**How.** Inside `batch_invariant_linear(model)`, every linear layer of the model's forward pass (its nn.Linear
layers; in MoE models also the routers and the experts, run "eager") is computed as matmuls of exactly `TILE_ROWS`
rows, the last tile zero-padded. One shape means one kernel. Measured there, for every linear shape of the embedded
model, 25 random (row count 1-1,100, row place) cases each: no row moved; in bfloat16 no row moved with the thread
count either, with torch's matmul. In float32 torch's matmul still moved with the thread count, oneDNN's did not,
so float32 tiles run through oneDNN where the torch build has it, over weights prepacked when the block starts.
bfloat16 tiles do the same on CPUs with bf16 units: torch hands them to oneDNN anyway, but reorders the weight into
oneDNN's layout at every call, and one tile shape is exactly what a prepacked weight serves best. Either way the
packed weights are a second copy of the linear weights while the block runs (about 270 MB for the embedded model).
A long call's leading full blocks may run in larger tiles (BIG_TILES), for a layer whose probe found them bitwise the
TILE_ROWS tiles on this machine: a row's bits are then the same in either, and still its own.

The cost, per call against one stock call (same machine, bfloat16, the embedded model's shapes): over torch's matmul
1.05-1.2x at 64 rows and 1.5-3x at 512; over prepacked weights 0.7-1.0x at 64 rows (the 576 x 576 projection 1.8x)
and 0.6-1.3x at 512. Whole jobs: docs/performance.md.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from cbgen.config.cpu import cpu_row
from cbgen.model.linear import MergedLinears, onednn_available, replaced_forwards

TILE_ROWS = 64  # rows per matmul: a decode step's size; measured cheaper than 32-row tiles (1.2x vs 1.7x at 64 rows)
# Larger tiles for the full blocks of a long call (a prompt chunk), per layer where a probe finds them bitwise the
# 64-row tiles (`big_tile_rows`). With AMX a 64-row tile's arithmetic is cheap and its oneDNN call is not: at 1,024
# rows the embedded model's qkv, output and gate/up projections cost 1.8-3.6x one stock call in 64-row tiles, 1.1-1.45x
# in 256-row ones; the down projection's 256-row tiles are not bitwise its 64-row ones there (and move with the thread
# count), so it keeps 128 or 64. Layers above BIG_TILE_MAX_WEIGHTS parameters are not probed: their arithmetic
# dominates the call, and the probe would cost start-up time.
BIG_TILES = (256, 128)
BIG_TILE_MAX_WEIGHTS = 4 * 1024 * 1024
_big_tiles: dict[tuple[Any, ...], int | None] = {}  # (shape, dtype, threads) -> the probe's answer, once a process


def _onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether float32 tiles over a plain weight run through oneDNN (torch's own matmul moved with the thread count)."""
    return dtype == torch.float32 and device.type == "cpu" and onednn_available()


def _packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a layer's tiles run over its weight prepacked for oneDNN: float32 (above), and bfloat16 on a CPU with
    bf16 units, where torch hands each tile to oneDNN anyway but reorders the weight at every call."""
    if dtype == torch.bfloat16:
        return device.type == "cpu" and onednn_available() and cpu_row().dtype == "bfloat16"
    return _onednn(dtype, device)


def _onednn_tile(source: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(source, weight, None, "none", [], "")


def fixed_shape_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       packed: torch.Tensor | None = None, big: int | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as matmuls of TILE_ROWS rows each: the same bits for a row whatever the rest.
    `packed`: the weight prepacked for oneDNN (`pack`), which saves oneDNN reordering it at every tile. `big`: a
    larger tile that `big_tile_rows` found bitwise the TILE_ROWS one for this weight, used for the call's leading
    full blocks of that size (a row's bits are the same in either)."""
    rows = x.reshape(-1, x.shape[-1])
    count, out_features = rows.shape[0], weight.shape[0]
    onednn = packed is not None or _onednn(rows.dtype, rows.device)
    transposed = weight.t()
    full = count - count % TILE_ROWS
    dnn_weight = packed if packed is not None else weight

    def tile(source: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        if not onednn:
            return torch.mm(source, transposed, out=target) if target is not None else torch.mm(source, transposed)
        result = _onednn_tile(source, dnn_weight)
        return target.copy_(result) if target is not None else result

    padded = None
    if full < count:  # the last rows, in a zero-padded tile of the same shape
        padded = rows.new_zeros(TILE_ROWS, rows.shape[1])
        padded[: count - full] = rows[full:]
    if full == 0 and padded is not None:  # one tile (a decode step): its rows are the result, no copy out
        out = tile(padded)[:count]
    elif count == TILE_ROWS:  # exactly one tile: the result itself
        out = tile(rows)
    else:
        out = rows.new_empty(count, out_features)
        size = big if big and packed is not None else TILE_ROWS
        in_big = full - full % size if size != TILE_ROWS else 0  # the leading rows in big tiles
        for start in range(0, in_big, size):
            tile(rows[start : start + size], out[start : start + size])
        for start in range(in_big, full, TILE_ROWS):
            tile(rows[start : start + TILE_ROWS], out[start : start + TILE_ROWS])
        if padded is not None:
            out[full:] = tile(padded)[: count - full]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out_features)


class _FixedShapeMode(TorchFunctionMode):
    """Routes `F.linear` to `fixed_shape_linear` while active (in the thread that entered it: modes are per thread)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and not torch.is_grad_enabled():
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() >= 1 and weight.dim() == 2 and x.dtype == weight.dtype:
                return fixed_shape_linear(x, weight, bias)
        return func(*args, **kwargs)


def _experts_implementation(model: torch.nn.Module) -> Any:
    """The model's MoE experts implementation (transformers' experts interface), or None when it has none."""
    getter = getattr(model, "get_experts_implementation", None)
    if not callable(getter) or not getattr(type(model), "_can_set_experts_implementation", lambda: False)():
        return None
    try:
        return getter()
    except (AttributeError, ValueError):
        return None


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight prepacked for oneDNN's tiles (float32; bfloat16 on CPUs with bf16 units), or None where tiles run
    over the plain weight. Measured on the embedded model's float32 shapes: a tile over the plain weight cost up to
    4.5x one stock call at 512 rows (oneDNN reorders the weight at every call), over the packed one 0.9-1.4x."""
    if not _packs(weight.dtype, weight.device):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), TILE_ROWS)


def big_tile_rows(weight: torch.Tensor, packed: torch.Tensor | None) -> int | None:
    """The largest of BIG_TILES whose rows are bitwise this weight's TILE_ROWS tiles, on this thread count and on one
    thread, for random rows (a kernel is chosen by shape, not by data: one draw tells them apart); None where none
    is, the weight is not prepacked or too large to gain. Probed once per shape, dtype and thread count."""
    if packed is None or weight.numel() > BIG_TILE_MAX_WEIGHTS:
        return None
    threads = torch.get_num_threads()
    key = (tuple(weight.shape), weight.dtype, threads)
    if key not in _big_tiles:
        _big_tiles[key] = _probe_big_tiles(weight, packed, threads)
    return _big_tiles[key]


def _probe_big_tiles(weight: torch.Tensor, packed: torch.Tensor, threads: int) -> int | None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for big in BIG_TILES:
            rows = torch.randn(big, weight.shape[1], generator=generator).to(weight.dtype)
            small = torch.cat([_onednn_tile(rows[start : start + TILE_ROWS], packed)
                               for start in range(0, big, TILE_ROWS)])
            if not torch.equal(_onednn_tile(rows, packed), small):
                continue
            try:
                torch.set_num_threads(1)
                alone = _onednn_tile(rows, packed)
            finally:
                torch.set_num_threads(threads)
            if torch.equal(alone, small):
                return big
    return None


def _tiled_forward(module: torch.nn.Linear, packed: torch.Tensor | None, big: int | None, x: torch.Tensor
                   ) -> torch.Tensor:
    if torch.is_grad_enabled() or x.dtype != module.weight.dtype:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return fixed_shape_linear(x, module.weight, module.bias, packed, big)


def _tiled(module: torch.nn.Linear) -> functools.partial:
    packed = pack(module.weight)
    return functools.partial(_tiled_forward, module, packed, big_tile_rows(module.weight, packed))


@contextmanager
def batch_invariant_linear(model: torch.nn.Module, merged: MergedLinears | None = None) -> Iterator[None]:
    """Inside the block, the model computes every linear layer in fixed-shape tiles: each `nn.Linear` through a
    forward of its own, and, in a model with MoE experts, every other `F.linear` of its forward pass (routers, the
    experts' matmuls) through a torch function mode, with the experts run "eager" (one matmul per expert; the fused
    grouped matmuls split by the batch's routing). The mode costs Python time on every operator (about 10 % of a
    decode step of the embedded model), which is why dense models, whose linear layers are all `nn.Linear`, do
    without it. `merged` linear layers (cbgen.model.fused) are tiled in place of those they compute. Everything is put
    back on exit."""
    experts = _experts_implementation(model)
    switch = experts is not None and set(experts.values()) != {"eager"}
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    if merged is not None:
        linears = merged.applied(linears)
    # the packed weights (float32; bfloat16 with bf16 units) are a second copy of the weights while the block runs
    forwards: dict[torch.nn.Module, object] = {module: _tiled(module) for module in linears}
    forward = model.forward

    def invariant_forward(self, *args, **kwargs):
        with _FixedShapeMode():
            return forward(*args, **kwargs)

    if experts is not None:
        forwards[model] = types.MethodType(invariant_forward, model)
    with replaced_forwards(forwards):
        if switch:
            getattr(model, "set_experts_implementation")("eager")  # noqa: B009 - a method of transformers' models only
        try:
            yield
        finally:
            if switch:
                getattr(model, "set_experts_implementation")(experts)  # noqa: B009
