"""Whether a model's fused decoder layers (cbgen.model.fused) can run their norms, rotary embedding and SiLU * up
as cbgen's compiled operators (cbgen/kernels/decoder_ops.cpp): what planning asks before it turns them on."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cbgen.model.fused import PROBE_ROWS, decoder_layers, rms_norm, rope


def compiled_ops_reason(model: torch.nn.Module) -> str | None:
    """Why the fused layers of `model` (fit for them: `unfit_reason`) cannot run their norms, rotary embedding and
    SiLU * up as cbgen's compiled operators (cbgen/kernels/decoder_ops.cpp), or None when they can. Builds the
    operators on first use; probes them against the eager pieces on this model's first layer: the rotary embedding and
    SiLU * up bitwise, RMSNorm to float rounding (its mean square sums in its own order)."""
    layer: Any = decoder_layers(model)[0]
    attn = layer.self_attn
    if hasattr(attn, "q_norm"):
        return "its attention normalises queries and keys per head (Qwen3), which the compiled operators do not"
    dtype = layer.input_layernorm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or attn.head_dim % 2 or attn.head_dim > 512:
        return "the compiled operators compute float32, bfloat16 and float16 with even head dimensions up to 512"
    from cbgen.kernels import kernel

    built = kernel("decoder_ops")
    if not built.loaded:
        return built.detail
    if layer.input_layernorm.weight.device.type == "meta":
        return None  # structure only: the replicas that load the weights run what their parent planned
    return _probe_ops(layer, torch.ops.cbgen_kernels)


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
