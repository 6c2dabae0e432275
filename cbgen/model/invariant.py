"""Batch-invariant linear layers: every matmul of the model's forward pass in fixed-shape row tiles, so that a row's
result does not depend on how many rows share the call, where it sits among them, or how many threads run it.
Where cbgen's compiled linear blocks serve the model (cbgen.model.tiles_kernel: float32 on AVX2 and up, bfloat16
with bfloat16 units), its `nn.Linear` layers run those instead, which need neither padding nor a probe; the tiles
below are the way everywhere else (float16, other CPUs, no compiler, MoE models' other matmuls).

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
A call may also run in tiles of other sizes (TILE_SIZES), for a layer whose probe found them bitwise the TILE_ROWS
tiles on this machine: larger ones for a long call, smaller ones for its last rows; a row's bits are then the same in
any of them, and still its own.

The cost, per call against one stock call (same machine, bfloat16, the embedded model's shapes): over torch's matmul
1.05-1.2x at 64 rows and 1.5-3x at 512; over prepacked weights 0.7-1.0x at 64 rows (the 576 x 576 projection 1.8x)
and 0.6-1.3x at 512. Whole jobs: docs/performance.md.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from cbgen.config.cpu import cpu_row
from cbgen.model import packs, tiles_kernel
from cbgen.model.linear import MergedLinears, onednn_available, onednn_unfit, replaced_forwards
from cbgen.process.changes import Threads
from cbgen.process.runtime import RUNTIME

TILE_ROWS = 64  # rows per matmul: a decode step's size, cheaper than 32-row tiles
# Other tile sizes, per layer, where a probe finds a row's bits in them those of a 64-row tile (`tile_sizes`): larger
# ones for a long call (a prompt chunk), smaller ones for the rest of a call, so that few rows are padded. Which sizes
# qualify is the kernel's choice, per shape and dtype: with AMX a 64-row tile's arithmetic is cheap and its oneDNN
# call is not, so larger tiles pay; in float32 under AVX2 the arithmetic is the cost, and smaller tiles pad less
# (figures: docs/performance.md, 'Why the constants are what they are'). Layers above
# TILE_PROBE_MAX_WEIGHTS parameters are not probed: their arithmetic dominates the call, the probe would cost
# start-up time, and the largest (the vocabulary projection) only sees a row per request in continuous batching.
TILE_SIZES = (8, 16, 32, 128, 256)
TILE_PROBE_MAX_WEIGHTS = 4 * 1024 * 1024
# What a tile's call costs beyond its arithmetic, in rows of arithmetic, by dtype: the plan of a call (`tile_plan`)
# weighs padded rows against calls with it (about 100 rows in bfloat16 with AMX, about 15 in float32 under AVX2
# (figures: docs/performance.md, 'Why the constants are what they are')). A plan only moves time, never a row's bits.
CALL_ROWS = {torch.bfloat16: 96, torch.float16: 96, torch.float32: 16}
_tile_sizes = RUNTIME.cache("linear tile sizes", "(shape, dtype, threads) -> the tile sizes probed bitwise the same")
PROBE_PEAK = 2.0**16  # how large the cancelling pair of a probe row makes one output's partial sums


def _onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether float32 tiles over a plain weight run through oneDNN (torch's own matmul moved with the thread count)."""
    return dtype == torch.float32 and device.type == "cpu" and onednn_available()


def _packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a layer's tiles run over its weight prepacked for oneDNN: float32 (above), and bfloat16 on a CPU with
    bf16 units, where torch hands each tile to oneDNN anyway but reorders the weight at every call."""
    if dtype == torch.bfloat16:
        return device.type == "cpu" and cpu_row().dtype == "bfloat16" and onednn_unfit(torch.bfloat16) is None
    return _onednn(dtype, device)


def _onednn_tile(source: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(source, weight, None, "none", [], "")


def fixed_shape_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       packed: torch.Tensor | None = None, sizes: tuple[int, ...] = ()) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as matmuls of TILE_ROWS rows each: the same bits for a row whatever the rest.
    `packed`: the weight prepacked for oneDNN (`pack`), which saves oneDNN reordering it at every tile. `sizes`:
    other tile sizes that `tile_sizes` found bitwise the TILE_ROWS one for this weight, which the call's plan may use
    too (`tile_plan`: a row's bits are the same in any of them)."""
    rows = x.reshape(-1, x.shape[-1])
    count, out_features = rows.shape[0], weight.shape[0]
    onednn = packed is not None or _onednn(rows.dtype, rows.device)
    transposed = weight.t()
    dnn_weight = packed if packed is not None else weight

    def tile(source: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        if not onednn:
            return torch.mm(source, transposed, out=target) if target is not None else torch.mm(source, transposed)
        return _onednn_tile(source, dnn_weight)

    plan = tile_plan(count, sizes if packed is not None else (), CALL_ROWS.get(rows.dtype, TILE_ROWS))
    if len(plan) == 1:  # one tile (a decode step): its rows are the result, no copy out
        size = plan[0][1]
        out = tile(rows if size == count else _padded(rows, 0, size))[:count]
    elif not onednn:
        out = rows.new_empty(count, out_features)
        for start, size in plan:
            if start + size <= count:
                tile(rows[start : start + size], out[start : start + size])
            else:  # the last rows, in a zero-padded tile of its size
                out[start:] = tile(_padded(rows, start, size))[: count - start]
    else:  # oneDNN returns each tile's result: one concatenation, not a copy each (5-27 % of a 520-1,024-row call)
        out = torch.cat([tile(rows[start : start + size]) if start + size <= count
                         else tile(_padded(rows, start, size))[: count - start] for start, size in plan])
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out_features)


@functools.lru_cache(maxsize=8192)
def tile_plan(count: int, sizes: tuple[int, ...] = (), call_rows: int = TILE_ROWS) -> tuple[tuple[int, int], ...]:
    """The tiles (start, rows) that cover `count` rows, each but the last whole, the last zero-padded where it runs
    past them: of TILE_ROWS rows or of any of `sizes`, the cheapest cover, each call weighed as `call_rows` rows of
    arithmetic beside the rows it computes (CALL_ROWS). Any plan gives a row the same bits, as the `sizes` are bitwise
    TILE_ROWS tiles (`tile_sizes`)."""
    choices = sorted({TILE_ROWS, *sizes})
    unit = math.gcd(*choices)
    units = -(-count // unit)
    # best[u]: (cost, -size of its first tile) of the cheapest cover of the rows from unit u on; at equal cost the
    # larger first tile (fewer calls, fewer copies)
    best: list[tuple[int, int]] = [(0, 0)] * (units + 1)
    for u in range(units - 1, -1, -1):
        best[u] = min((call_rows + size + (best[u + size // unit][0] if u + size // unit < units else 0), -size)
                      for size in choices)
    plan, u = [], 0
    while u < units:
        size = -best[u][1]
        plan.append((u * unit, size))
        u += size // unit
    return tuple(plan)


def _padded(rows: torch.Tensor, start: int, size: int) -> torch.Tensor:
    tile = rows.new_zeros(size, rows.shape[1])
    tile[: rows.shape[0] - start] = rows[start:]
    return tile


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


def tile_sizes(weight: torch.Tensor, packed: torch.Tensor | None) -> tuple[int, ...]:
    """Those of TILE_SIZES in which rows get the bits they get in TILE_ROWS tiles of this weight, on this thread count
    and on one thread, for the rows of `probe_rows` (a kernel is chosen by shape, not by data); none where the weight
    is not prepacked or too large to gain. Probed once per shape, dtype, thread count and machine (`_probe_name`), the
    answer kept in cbgen's kernels cache, so that a warm start reads it."""
    if packed is None or weight.numel() > TILE_PROBE_MAX_WEIGHTS:
        return ()
    threads = torch.get_num_threads()
    key = (tuple(weight.shape), weight.dtype, threads)
    if key not in _tile_sizes:
        known = _probed_before()
        name = _probe_name(weight, threads)
        if isinstance(known.get(name), list) and all(size in TILE_SIZES for size in known[name]):
            _tile_sizes[key] = tuple(known[name])
        else:
            _tile_sizes[key] = _probe_tile_sizes(weight, packed)
            _remember(name, _tile_sizes[key])
    return _tile_sizes[key]


PROBES_FILE = "tile-sizes.json"  # in cbgen's kernels cache: the probe's answers, by what they depend on


def _probe_name(weight: torch.Tensor, threads: int) -> str:
    """What a probe's answer depends on: the shape, dtype and thread count, torch (oneDNN's version), the CPU (its
    model and flags, and oneDNN's own settings in the environment) and the sizes probed; a change to any of them
    probes again."""
    import hashlib
    import os

    from cbgen.config.cpu import cpu_flags, cpu_model

    machine = [torch.__version__, cpu_model(), " ".join(sorted(cpu_flags())), repr(TILE_SIZES), repr(PROBE_PEAK),
               *sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("ONEDNN_", "DNNL_")))]
    digest = hashlib.sha256("\0".join(machine).encode()).hexdigest()[:16]
    return f"{'x'.join(map(str, weight.shape))}-{str(weight.dtype).removeprefix('torch.')}-{threads}t-{digest}"


@RUNTIME.memo("linear tile probes read", "the tile probes' answers kept in the kernels cache, as read from it")
@functools.lru_cache(maxsize=1)
def _probed_before() -> dict[str, Any]:
    from cbgen.cache_root import kernel_cache_dir
    from cbgen.files import read_json_or_none

    try:
        known = read_json_or_none(kernel_cache_dir() / PROBES_FILE)
    except Exception:  # noqa: BLE001 - no cache folder: every process probes
        return {}
    return known if isinstance(known, dict) else {}


def _remember(name: str, sizes: tuple[int, ...]) -> None:
    """Keeps a probe's answer for the next process (a warm start then probes nothing); an unwritable cache only
    costs the next process its probe."""
    from cbgen.cache_root import kernel_cache_dir
    from cbgen.files import read_json_or_none, write_json_atomic

    _probed_before()[name] = list(sizes)
    try:
        path = kernel_cache_dir() / PROBES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        known = read_json_or_none(path)
        write_json_atomic(path, (known if isinstance(known, dict) else {}) | {name: list(sizes)}, durable=False)
    except OSError:
        pass


def _probe_tile_sizes(weight: torch.Tensor, packed: torch.Tensor) -> tuple[int, ...]:
    span = max(*TILE_SIZES, TILE_ROWS)
    with torch.no_grad():
        rows = probe_rows(weight, span, torch.Generator().manual_seed(0))
        reference = _in_tiles(rows, packed, TILE_ROWS)
        found = []
        for size in TILE_SIZES:
            some = max(size, TILE_ROWS)  # rows of whole tiles of both sizes
            if not torch.equal(_in_tiles(rows[:some], packed, size), reference[:some]):
                continue
            with Threads(1):
                alone = _in_tiles(rows[:some], packed, size)
            if torch.equal(alone, reference[:some]):
                found.append(size)
    return tuple(found)


def cancelling_pairs(weight: torch.Tensor, generator: torch.Generator, sample: int = 256
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of `sample` output columns drawn at random, those with two equal nonzero weights: each column and the two
    places (`probe_rows`)."""
    drawn = torch.randperm(weight.shape[0], generator=generator)[:sample]
    if weight.shape[1] < 2:  # one input: no pair
        return drawn[:0], drawn[:0], drawn[:0]
    values, order = torch.sort(weight.detach()[drawn].float(), dim=1)
    equal = (values[:, 1:] == values[:, :-1]) & (values[:, 1:] != 0)
    have = equal.any(dim=1).nonzero().flatten()
    at = equal[have].to(torch.int8).argmax(dim=1)  # the first equal pair of each such column
    return drawn[have], order[have, at], order[have, at + 1]


def probe_rows(weight: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` random rows that tell two kernels apart whenever they add a row's products in another order.

    Random rows alone do not: two orders of a float32 sum differ by an ulp of it, and rounding the result to
    bfloat16 (2^-8) hides that in most outputs (measured: a 64-row tile against 8-row ones, 61,440 outputs, 0 to 12
    differed, often none). So each row also gets a pair of equal and opposite large entries at two places where one
    output column's weights are equal (`cancelling_pairs`): their products cancel exactly in that column, whose sum
    passes through partial sums of PROBE_PEAK and is left near 1, so that where the other products are added, before,
    between or after the pair, shows in its bfloat16 bits (the same tiles then differed in 40-190 outputs). Columns
    with equal weights are common in bfloat16 (256 values an octave); in float32, where rounding hides nothing, the
    rows may stay plain."""
    rows = torch.randn(count, weight.shape[1], generator=generator)
    columns, first, second = cancelling_pairs(weight, generator)
    if len(columns):
        pick = torch.randint(0, len(columns), (count,), generator=generator)
        peak = PROBE_PEAK / weight.detach().float()[columns[pick], first[pick]].abs()
        everyone = torch.arange(count)
        rows[everyone, first[pick]] = peak
        rows[everyone, second[pick]] = -peak
    return rows.to(weight.dtype)


def _in_tiles(rows: torch.Tensor, packed: torch.Tensor, size: int) -> torch.Tensor:
    """`rows` (a whole number of tiles of `size`) through the packed weight, `size` rows a call."""
    return torch.cat([_onednn_tile(rows[start : start + size], packed) for start in range(0, rows.shape[0], size)])


def _tiled_forward(module: torch.nn.Linear, packed: torch.Tensor | None, sizes: tuple[int, ...], x: torch.Tensor
                   ) -> torch.Tensor:
    if torch.is_grad_enabled() or x.dtype != module.weight.dtype:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return fixed_shape_linear(x, module.weight, module.bias, packed, sizes)


def _tiled(module: torch.nn.Linear, kernel: Any = None) -> functools.partial:
    if kernel is not None and tiles_kernel.layer_fits(module):
        return tiles_kernel.tiled_forward(kernel, module)
    packed = packs.kept(module.weight, "onednn tiles", pack)  # once per loaded model (cbgen.model.packs)
    return functools.partial(_tiled_forward, module, packed, tile_sizes(module.weight, packed))


@contextmanager
def batch_invariant_linear(model: torch.nn.Module, merged: MergedLinears | None = None, kernel: Any = None
                           ) -> Iterator[None]:
    """Inside the block, the model computes every linear layer in fixed-shape tiles: each `nn.Linear` through a
    forward of its own, and, in a model with MoE experts, every other `F.linear` of its forward pass (routers, the
    experts' matmuls) through a torch function mode, with the experts run "eager" (one matmul per expert; the fused
    grouped matmuls split by the batch's routing). The mode costs Python time on every operator (about 10 % of a
    decode step of the embedded model), which is why dense models, whose linear layers are all `nn.Linear`, do
    without it. `merged` linear layers (cbgen.model.fused) are tiled in place of those they compute. With `kernel`
    (torch.ops.cbgen_kernels, the compiled linear tiles loaded and fit for the model's dtype: cbgen.model.tiles_kernel)
    the `nn.Linear` layers run through it instead of this module's tiles. Everything is put back on exit."""
    experts = _experts_implementation(model)
    switch = experts is not None and set(experts.values()) != {"eager"}
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    if merged is not None:
        linears = merged.applied(linears)
    # the packed weights (float32; bfloat16 with bf16 units) are a second copy of the weights while the block runs
    forwards: dict[torch.nn.Module, object] = {module: _tiled(module, kernel) for module in linears}
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
