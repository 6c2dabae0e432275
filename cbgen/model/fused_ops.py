"""Whether a model's fused decoder layers (cbgen.model.fused) can run their norms, rotary embedding and SiLU * up
as cbgen's compiled operators (cbgen/kernels/decoder_ops.cpp): what planning asks before it turns them on."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cbgen.model.fused import PROBE_ROWS, decoder_layers, rms_norm, rope


def ops_unfit_reason(model: torch.nn.Module) -> str | None:
    """Why the fused layers of `model` (fit for them: cbgen.model.fused.unfit_reason) cannot run their norms, rotary
    embedding and SiLU * up as cbgen's compiled operators, told from the model's structure; or None."""
    layer: Any = decoder_layers(model)[0]
    attn = layer.self_attn
    if hasattr(attn, "q_norm"):
        return "its attention normalises queries and keys per head (Qwen3), which the compiled operators do not"
    dtype = layer.input_layernorm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or attn.head_dim % 2 or attn.head_dim > 512:
        return "the compiled operators compute float32, bfloat16 and float16 with even head dimensions up to 512"
    return None


def probe_ops(model: torch.nn.Module, ops: Any) -> str | None:
    """Why the compiled operators `ops` (torch.ops.cbgen_kernels, once cbgen.kernels loaded decoder_ops) do not
    compute what the eager pieces compute on this model's first layer, or None: the rotary embedding and SiLU * up
    bitwise, RMSNorm to float rounding (its mean square sums in its own order). A model whose weights are not loaded
    (the planning process of --data-parallel replicas) is taken on its structure."""
    layer: Any = decoder_layers(model)[0]
    if layer.input_layernorm.weight.device.type == "meta":
        return None
    return _probe_ops(layer, ops)


def _probe_ops(layer: Any, ops: Any) -> str | None:
    generator = torch.Generator().manual_seed(1)
    norm, dtype, dim = layer.input_layernorm, layer.input_layernorm.weight.dtype, layer.self_attn.head_dim
    rows = torch.randn(PROBE_ROWS, norm.weight.shape[0], generator=generator).to(dtype)
    qk = torch.randn(PROBE_ROWS, 3, dim, generator=generator).to(dtype)
    cos, sin = (torch.randn(PROBE_ROWS, dim, generator=generator).to(dtype) for _ in range(2))
    gate_up = torch.randn(PROBE_ROWS, 6, generator=generator).to(dtype)
    with torch.no_grad():
        rtol = 1e-5 if dtype == torch.float32 else 1e-2
        if not torch.allclose(ops.rms_norm(rows, norm.weight, norm.variance_epsilon).float(),
                              rms_norm(rows, norm).float(), rtol=rtol, atol=rtol):
            return "the compiled RMSNorm does not compute this model's"
        expected = rope(qk.unsqueeze(0), cos.unsqueeze(0).unsqueeze(2), sin.unsqueeze(0).unsqueeze(2))[0]
        rotated = qk.reshape(PROBE_ROWS, -1).clone()
        ops.rope_(rotated, cos, sin, 3, dim)
        if not torch.equal(rotated.view_as(qk), expected):
            return "the compiled rotary embedding does not compute this model's"
        gate, up = gate_up.split(3, dim=-1)
        if not torch.equal(ops.silu_mul(gate_up, 3), F.silu(gate) * up):
            return "the compiled SiLU * up does not compute this model's"
    return None
