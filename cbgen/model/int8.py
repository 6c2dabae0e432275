"""8-bit weights: a model's linear layers held as int8 with one scale per 32 inputs of each output (GGUF's Q8_0
scheme), a quarter of float32's memory, computed by cbgen's compiled kernel (cbgen/kernels/int8_linear.cpp), which
dequantizes a panel's inputs a chunk at a time inside the call, in a fixed order (batch invariance holds).

`--quantize int8` makes them from any float model at load; the model's embeddings, its output layer and its norms
stay as they are there. A Q8_0 GGUF file's are read from the file as they are, its embedding table and output layer
as int8 too (cbgen.model.q8_0); where it cannot be read so, it loads as transformers reads it (dequantized to float32,
exactly: a float16 scale times an int8 value) and is quantized again here by the same scheme, which gives back the
file's own int8 values and scales (tests/model/test_int8.py checks it against the gguf package's dequantization). A
layer whose input count is not a multiple of 32 stays float, and the summary says how many were kept so. Where the
compiled kernel is unavailable a layer dequantizes its whole weight each call (slow, right; run.json says why).

`--quantize w8a8` keeps the same weights and quantizes each layer's input rows too (`quantize_rows`, as llama.cpp's
Q8_0 path quantizes its activations): the kernel's products are then exact integers (AVX-512 VNNI, the panels arranged
for it once at load: `use_w8a8`), faster than bfloat16 where the CPU has VNNI, but the answers are those of the
dequantized model on quantized rows, which differ from the dequantized model's about as much as bfloat16's do.

Rows in float32 are computed in float32. Rows in bfloat16 are too, except on a CPU with bfloat16 units
(`bf16_arithmetic`), where the kernel dequantizes into bfloat16 and runs the bfloat16 micro-kernel (float32 sums): the
weights it computes with are then those of a bfloat16 model of the dequantized weights, and prefill runs at the
bfloat16 rate (twice float32's on an AVX-512 BF16 CPU) instead of float32's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cbgen.model import tiles_kernel

GROUP = 32  # inputs that share a scale (Q8_0's block)
KERNEL = "int8_linear"


def block_n() -> int:
    """Output columns a packed panel holds (a micro-kernel call's): the float32 tiles' width on this machine, since the
    kernel's arithmetic is theirs (oneDNN's float32 micro-kernel over dequantized chunks): 32 where torch runs AVX2
    kernels (0.70-0.95x the time of 64 on Llama-3.2-1B's projections at 16 and 512 rows, 2-core Zen 3:
    docs/performance.md), 64 elsewhere. The kernel reads the width from the packed weight."""
    return tiles_kernel.block_n(torch.float32)


@functools.cache
def bf16_arithmetic() -> bool:
    """Whether bfloat16 rows are computed in bfloat16 (`int8_linear_bf16`: chunks dequantized into bfloat16, the
    bfloat16 micro-kernel, float32 sums): where the CPU has bfloat16 units, as for the float tiles
    (tiles_kernel.unfit_reason). Elsewhere bfloat16 rows are converted to float32 and computed so."""
    return tiles_kernel.unfit_reason(torch.bfloat16) is None


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N, K/32]) by Q8_0's arithmetic: d = max|w| / 127 over each 32 inputs, stored as
    float16; q = w / d rounded half away from zero (C's roundf). A block of zeros has scale 0."""
    w = weight.detach().float().reshape(weight.shape[0], -1, GROUP)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = w * inverse
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
    return q.reshape(weight.shape[0], -1), d.squeeze(-1).half().float()


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight an int8 weight and its scales stand for (the reference the kernel is tested against)."""
    return (q.float().reshape(q.shape[0], -1, GROUP) * scales.unsqueeze(-1)).reshape(q.shape)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows as `--quantize w8a8` computes with them (float32): each row's every 32 inputs quantized as Q8_0 quantizes
    weights (d = max |x| / 127, kept in float32; x * (1 / d) rounded to nearest even, clamped to +-127), times d. The
    kernel's products of these with the int8 weights are exact integers; only its sums' order differs from a float
    matmul's."""
    blocks = x.float().reshape(*x.shape[:-1], -1, GROUP)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return ((blocks * inverse).round().clamp(-127, 127) * d).reshape(x.shape)


def pack(q: torch.Tensor, scales: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Panels of `width` outputs (this machine's `block_n()` where None), the kernel's layout: int8 [P, K, width] and
    float16 scales [P, K/32, width] (Q8_0's scales are float16: exact), the columns past N zero with zero scales."""
    width = width or block_n()
    n = q.shape[0]
    padded = -(-n // width) * width
    q = torch.nn.functional.pad(q, (0, 0, 0, padded - n))
    scales = torch.nn.functional.pad(scales, (0, 0, 0, padded - n))
    return (q.reshape(-1, width, q.shape[1]).transpose(1, 2).contiguous(),
            scales.half().reshape(-1, width, scales.shape[1]).transpose(1, 2).contiguous())


def unpack(packed: torch.Tensor, packed_scales: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]
    return q, packed_scales.transpose(1, 2).reshape(-1, packed_scales.shape[1])[:out_features].float()


class Int8Linear(torch.nn.Module):
    """A linear layer over int8 weights held in the kernel's panels (see the module); `ops` is torch.ops.cbgen_kernels
    with the kernel loaded, or None (each call dequantizes the weight). `of` makes one from int8 values and scales;
    `merged` computes several side by side (cbgen.model.fused merges a decoder layer's projections with it). With
    `w8a8` set (`use_w8a8`) its input rows are quantized too (`quantize_rows`) and the products are integers; with
    `arranged` its panels were arranged in place for VPDPBUSD at load and serve that kernel alone."""

    w8a8 = False
    arranged = False

    def __init__(self, packed: torch.Tensor, packed_scales: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int, ops: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = packed.shape[1], out_features
        self.packed: torch.Tensor
        self.packed_scales: torch.Tensor
        self.register_buffer("packed", packed)
        self.register_buffer("packed_scales", packed_scales)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.ops = ops

    @classmethod
    def of(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, ops: Any) -> Int8Linear:
        return cls(*pack(q, scales), bias, q.shape[0], ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        bf16 = x.dtype == torch.bfloat16 and bf16_arithmetic()
        if self.ops is not None and x.device.type == "cpu":
            if self.w8a8:
                out = self.ops.int8_linear_w8a8(rows, self.packed, self.packed_scales, self.bias, self.out_features,
                                                self.arranged)
            else:
                op = self.ops.int8_linear_bf16 if bf16 else self.ops.int8_linear
                out = op(rows, self.packed, self.packed_scales, self.bias, self.out_features)
        else:
            weight = dequantize(*unpack(self.packed, self.packed_scales, self.out_features))
            if bf16 and not self.w8a8:  # the kernel's weights: rounded to bfloat16
                weight = weight.bfloat16().float()
            inputs = quantize_rows(rows) if self.w8a8 else rows.float()
            out = torch.nn.functional.linear(inputs, weight, self.bias).to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows = ", int8 rows" if self.w8a8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (32-input scales){rows}"

    def bytes(self) -> int:
        """The bytes its weights hold: int8 values and float16 scales."""
        return int(self.packed.nbytes + self.packed_scales.nbytes)

    @property
    def width(self) -> int:
        """Output columns a panel holds (cbgen.model.int8.block_n when packed)."""
        return int(self.packed.shape[2])

    @staticmethod
    def mergeable(parts: list[Any]) -> bool:
        """Whether `parts` can compute side by side as one: int8 layers of one input size and one panel width whose
        panels hold no padding but in the last."""
        return all(isinstance(p, Int8Linear) for p in parts) and len({p.in_features for p in parts}) == 1 and \
            len({(p.w8a8, p.arranged) for p in parts}) == 1 and \
            len({p.width for p in parts}) == 1 and all(p.out_features % p.width == 0 for p in parts[:-1])

    @classmethod
    def merged(cls, parts: list[Int8Linear]) -> Int8Linear:
        """One layer computing `parts` side by side; each part's panels (and bias) become views of the merged ones."""
        with torch.no_grad():
            biases = [p.bias for p in parts]
            bias = torch.cat([b if b is not None else torch.zeros(p.out_features) for b, p in zip(biases, parts)]) \
                if any(b is not None for b in biases) else None
            merged = cls(_side_by_side([p.packed for p in parts]), _side_by_side([p.packed_scales for p in parts]),
                         bias, sum(p.out_features for p in parts), parts[0].ops)
            merged.w8a8, merged.arranged = parts[0].w8a8, parts[0].arranged
            panel = column = 0
            for p in parts:
                panels = p.packed.shape[0]
                p.packed = merged.packed[panel : panel + panels]
                p.packed_scales = merged.packed_scales[panel : panel + panels]
                if p.bias is not None:
                    p.bias.data = merged.bias.data[column : column + p.out_features]  # type: ignore[union-attr]
                panel, column = panel + panels, column + p.out_features
        return merged

    def views_of(self, parts: list[Int8Linear]) -> bool:
        """Each part's panels are still the views of this merged layer's they became."""
        panel = 0
        for p in parts:
            panels = p.packed.shape[0]
            if p.packed.data_ptr() != self.packed[panel : panel + panels].data_ptr() or \
                    p.packed.shape != self.packed[panel : panel + panels].shape:
                return False
            panel += panels
        return panel == self.packed.shape[0]

    @staticmethod
    def unmerged(parts: list[Int8Linear]) -> None:
        """Each part owns its panels again (a copy of its view)."""
        for p in parts:
            p.packed, p.packed_scales = p.packed.clone(), p.packed_scales.clone()
            if p.bias is not None:
                p.bias.data = p.bias.data.clone()


def _side_by_side(panels: list[torch.Tensor]) -> torch.Tensor:
    """The panels of several layers as one tensor: a view where they already lie one after another in one storage
    (an arena's: cbgen.model.q8_0), else a copy."""
    first = panels[0]
    offset = first.storage_offset()
    for p in panels:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or \
                p.storage_offset() != offset:
            return torch.cat(panels)
        offset += p.numel()
    shape = (sum(p.shape[0] for p in panels), *first.shape[1:])
    return first.as_strided(shape, first.stride(), first.storage_offset())


@dataclass
class Quantized:
    """What `quantize_model` did, for run.json."""

    layers: int = 0
    kept_float: list[str] = field(default_factory=list)  # layers left in float, with why
    bytes_before: int = 0
    bytes_after: int = 0
    kernel: str = ""  # "compiled", or why each call dequantizes
    loader: str = "quantized at load"  # or how else the int8 values were had (cbgen.model.q8_0)
    embeddings: str = "float"  # "int8" where the embedding table is held so too

    def summary(self) -> dict[str, Any]:
        return {"quantized": "int8", "layers": self.layers, "kept_float": self.kept_float[:8],
                "kept_float_count": len(self.kept_float), "weight_bytes_before": self.bytes_before,
                "weight_bytes_after": self.bytes_after, "kernel": self.kernel, "loader": self.loader,
                "embeddings": self.embeddings}


def cast_around(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The model in `dtype` around its int8 layers, for a job asked to run in `dtype` (int8 weights are made and read
    in float32, where their values come back exactly): every float parameter outside the int8 layers (norms, layers
    kept float, a float embedding table) cast, and modules with an `out_dtype` (an int8 embedding table's lookup)
    answering in it. The int8 layers keep their panels, float16 scales and float32 bias; buffers (rotary
    frequencies) stay as loaded, as in a model loaded in `dtype`."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            continue
        if hasattr(module, "out_dtype"):
            setattr(module, "out_dtype", dtype)  # noqa: B010 (an attribute of some modules only)
        for parameter in module.parameters(recurse=False):
            if parameter.is_floating_point():
                parameter.data = parameter.data.to(dtype)
    model.config.dtype = dtype


def kernel_ops() -> tuple[Any, str]:
    from cbgen.kernels import kernel

    built = kernel(KERNEL)
    return (torch.ops.cbgen_kernels, "compiled") if built.loaded else (None, f"eager dequantization: {built.detail}")


def quantize_model(model: torch.nn.Module, compiled: bool = True) -> Quantized:
    """Every linear layer of the model's decoder layers replaced by an Int8Linear, its float weight dropped; the
    embeddings and the output layer stay."""
    from cbgen.model.fused import decoder_layers

    ops, why = kernel_ops() if compiled else (None, "eager dequantization: asked for")
    done = Quantized(kernel=why)
    for index, layer in enumerate(decoder_layers(model)):
        for name, module in list(layer.named_modules()):
            if type(module) is not torch.nn.Linear:
                continue
            where = f"layers.{index}.{name}"
            if module.in_features % GROUP or module.weight.device.type != "cpu":
                done.kept_float.append(f"{where}: {module.in_features} inputs, not a multiple of {GROUP}"
                                       if module.in_features % GROUP else f"{where}: not on the CPU")
                continue
            q, scales = quantize(module.weight)
            replacement = Int8Linear.of(q, scales, module.bias, ops)
            done.layers += 1
            done.bytes_before += module.weight.numel() * module.weight.element_size()
            done.bytes_after += replacement.bytes()
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, replacement)
    return done


def use_w8a8(model: torch.nn.Module) -> dict[str, str]:
    """Every int8 layer of the model computing with int8 rows too (`--quantize w8a8`), its panels arranged in place
    for VPDPBUSD where the kernel runs it (not those an int8 embedding table looks rows up in: a tied output layer's);
    what run.json says of it."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    looked_up = {m.table.packed.data_ptr() for m in model.modules() if hasattr(m, "table")
                 and isinstance(m.table, Int8Linear)}  # cbgen.model.q8_0.Int8Embedding's
    ops = layers[0].ops if layers else None
    vnni = ops is not None and bool(ops.int8_w8a8_vnni(layers[0].width))
    for layer in layers:
        layer.w8a8 = True
        if ops is not None and vnni and layer.packed.data_ptr() not in looked_up and layer.packed.is_contiguous():
            ops.int8_w8a8_arrange_(layer.packed)
            layer.arranged = True
    if ops is None:
        how = "eager: the rows quantized, then a float32 matmul of the dequantized weights (the kernel did not build)"
    elif vnni:
        arranged = sum(layer.arranged for layer in layers)
        how = f"compiled: integer products (AVX-512 VNNI), {arranged} of {len(layers)} layers arranged for them at load"
    else:
        how = "compiled, plain loop: this CPU has no AVX-512 VNNI (slower than --quantize int8 here)"
    return {"arithmetic": "w8a8", "w8a8": how}


def w8a8_unfit() -> str | None:
    """Why `--quantize w8a8` would run its plain loop here (correct, slow), or None where the kernel has integer
    products (AVX-512 VNNI) at this machine's panel width."""
    ops, why = kernel_ops()
    if ops is None:
        return why
    return None if ops.int8_w8a8_vnni(block_n()) else "no AVX-512 VNNI here (w8a8 would run its plain loop)"


def gguf_is_q8_0(path: Path, memo: Path | None) -> bool:
    """Whether a GGUF file's decoder-layer matrices are all Q8_0, read from its tensor table once per file (the
    answer kept in `memo` by the file's size and mtime, beside its digest: parsing a file's metadata takes seconds)."""

    def read() -> bool:
        import gguf

        from cbgen.model.gguf_parse import parsed_once

        with parsed_once():
            reader = gguf.GGUFReader(path)
            types = {tensor.tensor_type for tensor in reader.tensors
                     if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and len(tensor.shape) == 2}
        return types == {gguf.GGMLQuantizationType.Q8_0}

    from cbgen.files import file_fact

    return bool(file_fact(path, memo, "q8_0", read, bool))


def refusal(quantize: str, adapters: bool, tp_size: int, device: str) -> str | None:
    """Why `--quantize int8` (or w8a8) cannot run with these settings, in one line, or None."""
    if quantize not in ("int8", "w8a8"):
        return None
    if adapters:
        return (f"--quantize {quantize} with --adapter: LoRA adapters are merged into float weights, and int8 ones "
                "have none; run the adapters on the float model (--quantize none)")
    if tp_size > 1:
        return f"--quantize {quantize} with --tp: int8 weights are not sharded; run one process, or --quantize none"
    if device == "cuda":
        return f"--quantize {quantize} runs on the CPU (cbgen's compiled kernel); on a GPU use --quantize none"
    return None
