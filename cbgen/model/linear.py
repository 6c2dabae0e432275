"""How linear layers run on CPU: the float32 vocabulary projection in column chunks (on by default, where bitwise
the same), bfloat16 linear layers at a few row counts (on by default), and float32 or bfloat16 linear layers through
oneDNN with prepacked weights (`--onednn-linear`), an opt-in alternative to torch's default matmul.

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

import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

VOCAB_CHUNK = 2048  # output columns per matmul (measured best of 2,048 / 4,096 / 8,192 at 64 rows)
CHUNK_ROWS = 128  # chunk only batches of at most this many rows: decode-sized, where chunks were measured faster
PROBE_ROWS = (1, 3, 17, 64, CHUNK_ROWS)

PACK_ROWS = 64  # the batch-size hint oneDNN packs for: a decode step's rows; results do not depend on it


PACKED_DTYPES = (torch.float32, torch.bfloat16)

ROW_STEP = 64  # row buckets: multiples of SMALL_STEP up to this, then four per doubling
SMALL_STEP = 8
BUCKETED_DTYPES = (torch.bfloat16, torch.float16)  # what torch hands to oneDNN, whose kernels are cached per shape


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != self._cbgen_packed.dtype or x.device.type != "cpu" or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, self.weight, self.bias)  # anything else: the stock path
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, self._cbgen_packed, self.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Runs every float32 or bfloat16 CPU `nn.Linear` of `model` through oneDNN with prepacked weights; returns how
    many."""
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype not in PACKED_DTYPES:
            continue
        if module.weight.device.type != "cpu":
            continue
        with torch.no_grad():
            module._cbgen_packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS)
        vars(module)["forward"] = types.MethodType(_forward, module)  # this module's own forward
        count += 1
    return count


def uses_onednn_linear(model: torch.nn.Module) -> bool:
    return any(hasattr(module, "_cbgen_packed") for module in model.modules())


@contextmanager
def onednn_linear(model: torch.nn.Module) -> Iterator[int]:
    """Every float32 or bfloat16 CPU `nn.Linear` of `model` through oneDNN inside the block, and back as it was after
    it (the chunked vocabulary projection included): how `cbgen bench`'s cbgen-onednn path measures the lever against
    the stock path on one loaded model. Yields how many layers it switched; none when the
    model already runs through oneDNN, which the block then leaves alone."""
    if uses_onednn_linear(model):
        yield 0
        return
    saved = {module: module.__dict__.get("forward") for module in model.modules() if type(module) is torch.nn.Linear}
    try:
        yield use_onednn_linear(model)
    finally:
        for module, forward in saved.items():
            module.__dict__.pop("_cbgen_packed", None)
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                vars(module)["forward"] = forward


def _chunked_forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > CHUNK_ROWS or x.dtype != self.weight.dtype or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, self.weight)
    return _chunked(rows, self.weight).view(*x.shape[:-1], self.weight.shape[0])


def _chunked(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], VOCAB_CHUNK):
        torch.mm(rows, weight[start : start + VOCAB_CHUNK].t(), out=out[:, start : start + VOCAB_CHUNK])
    return out


def _bitwise_same(weight: torch.Tensor) -> bool:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for count in PROBE_ROWS:
            rows = torch.randn(count, weight.shape[1], generator=generator, dtype=weight.dtype)
            if not torch.equal(_chunked(rows, weight), torch.nn.functional.linear(rows, weight)):
                return False
    return True


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's output projection (transformers' models have one), or None."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    return output_embeddings() if callable(output_embeddings) else None


def chunk_vocab_projection(model: torch.nn.Module) -> bool:
    """Computes the float32 CPU output projection of `model` in column chunks for decode-sized batches, when it is a
    plain bias-free `nn.Linear` over more than two chunks of vocabulary and the probe finds the result bitwise the
    same as one matmul's. Returns whether it did."""
    head = _output_head(model)
    if type(head) is not torch.nn.Linear or head.bias is not None or hasattr(head, "_cbgen_packed"):
        return False
    weight = head.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[0] <= 2 * VOCAB_CHUNK:
        return False
    if not _bitwise_same(weight.detach()):
        return False
    vars(head)["forward"] = types.MethodType(_chunked_forward, head)
    head._cbgen_chunked = True
    return True


def bucket(rows: int) -> int:
    """The row count a matmul of `rows` rows runs at with row buckets (see the module)."""
    step = SMALL_STEP if rows <= ROW_STEP else 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def _bucketed_forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    padded = bucket(count)
    if padded == count or x.dtype != self.weight.dtype or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, self.weight, self.bias)
    out = torch.nn.functional.linear(torch.nn.functional.pad(rows, (0, 0, 0, padded - count)), self.weight, self.bias)
    return out[:count].view(*x.shape[:-1], out.shape[-1])


def bucket_linear_rows(model: torch.nn.Module) -> int:
    """Runs every bfloat16 or float16 CPU `nn.Linear` of `model` (that has no forward of cbgen's already) at bucketed
    row counts; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or "forward" in vars(module):
            continue
        if module.weight.dtype not in BUCKETED_DTYPES or module.weight.device.type != "cpu":
            continue
        vars(module)["forward"] = types.MethodType(_bucketed_forward, module)
        vars(module)["_cbgen_bucketed"] = True
        count += 1
    return count


def linear_kind(model: torch.nn.Module) -> str:
    """How the model's linear layers run, for run.json and bench.json."""
    if uses_onednn_linear(model):
        return "onednn"
    if hasattr(_output_head(model), "_cbgen_chunked"):
        return f"stock, vocabulary in {VOCAB_CHUNK}-column chunks"
    if hasattr(_output_head(model), "_cbgen_bucketed"):
        return f"stock, rows in buckets (multiples of {SMALL_STEP} to {ROW_STEP}, then four per doubling)"
    return "stock"
