"""How linear layers run on CPU: the float32 vocabulary projection in column chunks (on by default, where bitwise
the same), bfloat16 linear layers at a few row counts (on by default), and float32 or bfloat16 linear layers through
oneDNN with prepacked weights (`--onednn-linear`), an opt-in alternative to torch's default matmul.

Which one a job runs is decided in planning (cbgen.engine.setup, `LINEAR_KINDS`), and `linear_layers(model, kind)`
installs it on the model's `nn.Linear` modules for the life of one engine (cbgen.engine.scope), putting each module's
forward back on exit: outside an engine the model computes as transformers built it.

**Vocabulary projection in column chunks.** MKL's sgemm computes a decode step's projection onto a large vocabulary
(64 x 576 x 49,152 for the embedded model) far below its rate on smaller matrices; the same product computed 2,048
output columns at a time was 1.8x faster at 49-64 rows and bitwise the same (2-core AMD EPYC, AVX2; no gain at 256
rows, so prompt-sized batches keep one matmul). Every column's dot product is the same one either way, but a BLAS is
free to pick kernels by shape, so it is switched on only after a probe at load time finds it bitwise equal to the
plain matmul on this machine, with the model's own weights, at several row counts.

**oneDNN with prepacked weights.**

torch hands a bfloat16 CPU matmul to oneDNN too, but with the weight in torch's layout, which oneDNN reorders into
its own on every call. Reordered once at load, the matmuls of a 64-sequence decode step of the embedded model ran
1.3-2.2x as fast, each timed alone (2-core Intel Xeon with AMX: the vocabulary projection 9.9 -> 4.4 ms, the MLP's
down projection 193 -> 88 us), bitwise the stock result at 64 rows. Whole jobs did not follow: in a step the weights
stream from memory, and `benchmarks/prepacked_linear.py` (stock and prepacked alternating on one loaded model, the
fixed workload) gave time ratios 0.81, 0.985 and 1.04, so for bfloat16 it stays opt-in.

For float32, torch uses MKL's sgemm. On a 2-core AMD EPYC (AVX2), MKL reached 36 GFLOP/s on the vocabulary projection
of a 64-sequence decode step where oneDNN with prepacked weights reached 101; the MLP projections gained 1.2-1.5x at
1,024 rows. Whole jobs of the embedded SmolLM2-135M ran 0.98-1.22x as fast (docs/performance.md, "Against llama.cpp
on an AVX2 CPU"), with the same greedy tokens for all 360 requests. In float32 each row's result no longer depends on
how many rows share the matmul (measured: bitwise the same for 1 to 1,024 rows; MKL's are not), but the sums run in
another order than MKL's, so a greedy token can flip at a near-tie (measured: none in 520 requests): opt-in too.

Either way the prepacked weights are a second copy (the parameters stay, for tied embeddings, batch-invariant tiles
and saving): about 270 MB for the embedded model in bfloat16.

**bfloat16 row counts in buckets (on by default; `--no-linear-row-buckets`).** oneDNN builds a kernel for every
(row count, weight shape) it meets and keeps it (two caches of 1,024 entries each), about 0.7 MB each; under
continuous batching a step's row count is whatever its prompts and decodes add up to. HumanEval's 164 prompts through
the embedded model met 464 such shapes (108 row counts). In buckets, linear layers compute a few row counts only
(multiples of `SMALL_STEP` up to `ROW_STEP`, then four per doubling: at most a quarter more rows), the extra rows
zero and cut from the result: about 100 shapes, and that job's peak RSS 1,678 -> 1,535 MB (2-core Intel Xeon with
AMX). The padding has a price of its own (the copy; and oneDNN's kernels are not faster at every larger row count),
which coarser buckets paid: powers of two to 64, then multiples of 64, ran a whole job of varied batches about 10 %
slower. These did not, within measurement noise (figures: docs/performance.md). A 64-sequence decode step is a
bucket already.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cbgen.errors import first_line
from cbgen.process.runtime import RUNTIME

# output columns per matmul, and chunks only for batches of at most CHUNK_ROWS rows (decode-sized), where they pay
# (figures: docs/performance.md, 'Why the constants are what they are')
VOCAB_CHUNK = 2048
CHUNK_ROWS = 128
PROBE_ROWS = (1, 3, 17, 64, CHUNK_ROWS)

PACK_ROWS = 64  # the batch-size hint oneDNN packs for: a decode step's rows; results do not depend on it

PACKED_DTYPES = (torch.float32, torch.bfloat16)

ROW_STEP = 64  # row buckets: multiples of SMALL_STEP up to this, then four per doubling
SMALL_STEP = 8
BUCKETED_DTYPES = (torch.bfloat16, torch.float16)  # what torch hands to oneDNN, whose kernels are cached per shape

# How a job's linear layers run (the plan's `linear`), and what run.json says of each
STOCK = "stock"
VOCABULARY_CHUNKS = "vocabulary in chunks"
ROW_BUCKETS = "row buckets"
ONEDNN = "onednn"
TILES = "fixed-shape tiles"  # batch invariance: cbgen.model.invariant
LINEAR_KINDS = {
    STOCK: "stock",
    VOCABULARY_CHUNKS: f"stock, vocabulary in {VOCAB_CHUNK}-column chunks",
    ROW_BUCKETS: f"stock, rows in buckets (multiples of {SMALL_STEP} to {ROW_STEP}, then four per doubling)",
    ONEDNN: "onednn, weights prepacked",
    TILES: "batch-invariant, rows in blocks of 64 (engine_scope.linear_kernel says whose)",
}


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@RUNTIME.memo("onednn linear probe", "dtype -> why oneDNN cannot run prepacked linear layers in it here, tried once")
@functools.lru_cache(maxsize=4)
def onednn_unfit(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot run prepacked linear layers in `dtype` on this CPU, or None when it can: tried once on a
    small layer (oneDNN's bfloat16 path needs AVX-512 BF16, AVX-NE-CONVERT or AVX-512 BW/VL/DQ: on an AVX2-only
    CPU it raises)."""
    if dtype not in PACKED_DTYPES:
        return f"oneDNN packs float32 or bfloat16 layers, not {str(dtype).removeprefix('torch.')}"
    if not onednn_available():
        return "this torch build has no oneDNN (mkldnn) linear"
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as e:
        return f"oneDNN cannot run {str(dtype).removeprefix('torch.')} linear layers on this CPU ({first_line(e)})"
    return None


def onednn_refusal(device: str, dtype: torch.dtype, tp_size: int = 1) -> str | None:
    """Why --onednn-linear cannot run a model on `device` in `dtype`, as the one-line message the job ends with, or
    None when it can: asked once the device and dtype are known, before the weights load, and again by the plan."""
    if device != "cpu" or dtype not in PACKED_DTYPES or tp_size > 1:
        return "--onednn-linear applies to float32 or bfloat16 on CPU in one process: add --device cpu, without --tp"
    unfit = onednn_unfit(dtype)
    if unfit is None:
        return None
    return f"--onednn-linear: {unfit}; drop the flag" + (" (--dtype float32 runs it)" if dtype != torch.float32 else "")


@dataclass(frozen=True)
class MergedLinears:
    """Linear layers that compute several of the model's side by side (cbgen.model.fused): the engine's linear kind
    is installed on them in place of the layers they replace."""

    linears: tuple[torch.nn.Linear, ...]
    replaced: frozenset[int]  # id() of the model's layers they compute

    def applied(self, modules: list[torch.nn.Linear]) -> list[torch.nn.Linear]:
        return [m for m in modules if id(m) not in self.replaced] + list(self.linears)


def _linears(model: torch.nn.Module, merged: MergedLinears | None = None) -> list[torch.nn.Linear]:
    """The model's plain CPU `nn.Linear` modules (not subclasses: quantized or tensor-parallel layers keep theirs),
    with `merged` ones in place of those they compute."""
    found = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"]
    return merged.applied(found) if merged is not None else found


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's output projection (transformers' models have one), or None."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    return output_embeddings() if callable(output_embeddings) else None


# oneDNN with prepacked weights -------------------------------------------------------------------------------------


def _packed_forward(module: torch.nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != packed.dtype or x.device.type != "cpu" or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, module.weight, module.bias)  # anything else: the stock path
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, module.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def _onednn(module: torch.nn.Linear):
    if onednn_unfit(module.weight.dtype) is not None:  # the layer keeps the stock path
        return None
    from cbgen.model import packs

    packed = packs.kept(module.weight, "onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach(),
                                                                                                   PACK_ROWS))
    return functools.partial(_packed_forward, module, packed)


# the vocabulary projection in column chunks --------------------------------------------------------------------------


def _chunked(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], VOCAB_CHUNK):
        torch.mm(rows, weight[start : start + VOCAB_CHUNK].t(), out=out[:, start : start + VOCAB_CHUNK])
    return out


def _chunked_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > CHUNK_ROWS or x.dtype != module.weight.dtype or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, module.weight)
    return _chunked(rows, module.weight).view(*x.shape[:-1], module.weight.shape[0])


@RUNTIME.memo("linear chunks probe", "shape -> whether column chunks compute bitwise as one matmul here")
@functools.lru_cache(maxsize=8)
def chunks_bitwise_same(out_features: int, in_features: int) -> bool:
    """Whether this machine computes a float32 projection of this shape in column chunks bitwise as one matmul, at
    every probed row count (random weights: the kernels follow the shape)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    with torch.no_grad():
        for count in PROBE_ROWS:
            rows = torch.randn(count, in_features, generator=generator)
            if not torch.equal(_chunked(rows, weight), torch.nn.functional.linear(rows, weight)):
                return False
    return True


def vocabulary_chunks_apply(model: torch.nn.Module) -> bool:
    """Whether the model's output projection is a float32 CPU bias-free `nn.Linear` over more than two chunks of
    vocabulary that this machine computes in chunks bitwise as one matmul (needs only the model's structure)."""
    head = _output_head(model)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    weight = head.weight
    if weight.dtype != torch.float32 or weight.device.type not in ("cpu", "meta") or weight.shape[0] <= 2 * VOCAB_CHUNK:
        return False
    return chunks_bitwise_same(weight.shape[0], weight.shape[1])


# bfloat16 rows in buckets ------------------------------------------------------------------------------------------


def bucket(rows: int) -> int:
    """The row count a matmul of `rows` rows runs at with row buckets (see the module)."""
    step = SMALL_STEP if rows <= ROW_STEP else 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def _bucketed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    padded = bucket(count)
    if padded == count or x.dtype != module.weight.dtype or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, module.weight, module.bias)
    out = torch.nn.functional.linear(torch.nn.functional.pad(rows, (0, 0, 0, padded - count)), module.weight,
                                     module.bias)
    return out[:count].view(*x.shape[:-1], out.shape[-1])


# installing one kind for an engine's life --------------------------------------------------------------------------


@contextmanager
def replaced_forwards(forwards: dict[torch.nn.Module, object]) -> Iterator[None]:
    """Each module computes through its given forward while the block runs. A module that already has a forward of
    its own (another engine's, another library's) raises RuntimeError: two owners cannot both hold it."""
    taken = [module for module in forwards if "forward" in vars(module)]
    if taken:
        raise RuntimeError(f"{len(taken)} modules ({type(taken[0]).__name__}, ...) already have a forward of their own "
                           "(another engine on this model, or another library's patch)")
    for module, forward in forwards.items():
        vars(module)["forward"] = forward
    try:
        yield
    finally:
        for module, forward in forwards.items():
            if vars(module).get("forward") is forward:
                del vars(module)["forward"]


@contextmanager
def linear_layers(model: torch.nn.Module, kind: str, merged: MergedLinears | None = None) -> Iterator[int]:
    """The model's linear layers (and `merged` ones in place of those they compute) run as `kind` (STOCK,
    VOCABULARY_CHUNKS, ROW_BUCKETS or ONEDNN) while the block runs; yields how many layers were switched. TILES is
    cbgen.model.invariant's."""
    forwards: dict[torch.nn.Module, object] = {}
    if kind == ONEDNN:
        for module in _linears(model, merged):
            forward = _onednn(module)
            if forward is not None:
                forwards[module] = forward
    elif kind == ROW_BUCKETS:
        forwards = {m: types.MethodType(_bucketed_forward, m) for m in _linears(model, merged)
                    if m.weight.dtype in BUCKETED_DTYPES}
    elif kind == VOCABULARY_CHUNKS:
        head = _output_head(model)
        if isinstance(head, torch.nn.Linear):
            forwards = {head: types.MethodType(_chunked_forward, head)}
    elif kind != STOCK:
        raise ValueError(f"not a linear kind linear_layers installs: {kind!r}")
    with replaced_forwards(forwards):
        yield len(forwards)
