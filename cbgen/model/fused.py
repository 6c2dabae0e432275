"""Fused decoder layers: the decoder layer of the architectures cbgen knows, computed with fewer, larger operators.

A decode step of the embedded model at 64 sequences is dominated by operators far too small for their call cost: on
a 2-core AMD EPYC Zen 4 (bfloat16, torch.profiler, `benchmarks/profile_step.py`) each of the 30 layers ran 7 matmuls
of 64 rows and some 40 elementwise operators, copies and views, and the time outside matmuls and attention was 40 %
of the step. `fused_layers(model)` gives each decoder layer a forward of its own for the life of one engine
(cbgen.engine.scope), which computes what transformers' forward computes with:

- the query, key and value projections as one matmul, and the MLP's gate and up projections as one (their weights
  laid end to end in one tensor; the model's own parameters become views of it, so nothing is held twice);
- the rotary embedding applied to queries and keys in one pass (Llama's formula, operator for operator: the bits are
  transformers');
- RMSNorm with its intermediate in place (operator for operator transformers', bitwise the same);
- SiLU(gate) * up and the residual additions in place.

The merge is done once per model, the first time an engine fuses its layers, and is the model's own from then on: its
projections stay views of the merged tensors (equal values, one storage per group), which every later engine on the
model reuses without copying (`_merge`, checked each time to still be the model's weights: a replaced or moved
parameter is merged again). `separate(model)` gives each projection its own storage again (before saving the
model, whose safetensors writer refuses tensors that share memory).

Attention itself still goes through transformers' attention registry (cbgen's per-sequence function on CPU, or the
stock one), so the engine's cache and masks are untouched. The merged matmuls sum each output in the same order
along its inputs, but a BLAS may pick another kernel for the wider matrix, so results may differ from the stock path
in the last bit: float32 greedy tokens are checked identical to `model.generate` on the architecture matrix
(tests/model/test_architectures.py), and the bfloat16 agreement is stated in tests/model/test_fused.py.

A model is fused only where every decoder layer is one the forward was written for (Llama, Mistral, Qwen2, Qwen3:
`FUSED_ARCHITECTURES`), with plain `nn.Linear` projections, SiLU, transformers' own forwards (no other patch) and a
validated transformers version, and where its pieces probe equal to the stock ones on this model (`unfit_reason`).
Elsewhere the model keeps transformers' layers, and run.json says why.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cbgen.model.linear import MergedLinears

# decoder layer class -> where its attention's sliding window comes from ("config", "module" or None: it passes none)
FUSED_ARCHITECTURES: dict[str, str | None] = {
    "LlamaDecoderLayer": None,
    "MistralDecoderLayer": "config",
    "Qwen2DecoderLayer": "module",
    "Qwen3DecoderLayer": "module",
}
PROBE_ROWS = 5


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (`model.model.layers` in transformers' causal LMs), or [] when it has none."""
    getter = getattr(model, "get_decoder", None)
    try:
        decoder = getter() if callable(getter) else None
    except (AttributeError, ValueError):
        decoder = None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def _stock_forward(module: torch.nn.Module) -> bool:
    """The module computes through its class's forward, as transformers defines it (no other patch on it)."""
    forward = getattr(type(module), "forward", None)
    return "forward" not in vars(module) and getattr(forward, "__module__", "").startswith("transformers.models.")


def _structure_reason(layer: Any) -> str | None:
    name = type(layer).__name__
    if name not in FUSED_ARCHITECTURES:
        return f"its decoder layers ({name}) are not one of {', '.join(sorted(FUSED_ARCHITECTURES))}"
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    parts: list[Any] = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    parts += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if _int8(parts):  # cbgen's int8 layers (cbgen.model.int8): merged panel by panel
        if not all(type(parts[0]).mergeable(group) for group in _groups(layer)):
            return "its int8 projections cannot be merged (a part's outputs are not whole panels)"
    elif any(type(p) is not torch.nn.Linear for p in parts):
        return "its projections are not plain torch.nn.Linear layers (quantized or tensor-parallel)"
    else:
        weights = [p.weight for p in parts]
        # meta: a process that plans for --data-parallel replicas, which load the weights (on CPU) themselves
        if len({(w.dtype, w.device) for w in weights}) != 1 or weights[0].device.type not in ("cpu", "meta"):
            return "its projections are not all CPU tensors of one dtype"
    for module in (layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm,
                   *(getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n))):
        if not _stock_forward(module):
            return f"{type(module).__name__} does not run transformers' own forward (another library patched it)"
    if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
        return f"its MLP activation is {type(mlp.act_fn).__name__}, not SiLU"
    if not isinstance(getattr(layer.input_layernorm, "variance_epsilon", None), float):
        return "its norms are not RMSNorm"
    if getattr(attn, "training", False) or getattr(attn, "attention_dropout", 0.0):
        return "attention dropout is on"
    return None


def rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' Llama RMSNorm, operator for operator (so bitwise), with its float32 intermediate in place."""
    dtype = x.dtype
    h = x.to(torch.float32)
    scale = torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon))
    h = h.mul_(scale) if h is not x else h * scale
    return norm.weight * h.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding on [batch, tokens, heads, dim] (queries and keys side by side), operator for operator
    transformers' `apply_rotary_pos_emb` (so bitwise): x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated * sin)


@dataclass
class _Fused:
    """One decoder layer's fused forward: its merged projections and shapes."""

    layer: Any  # the decoder layer (its self_attn, mlp and norms)
    qkv: torch.nn.Linear
    gate_up: torch.nn.Linear
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    window: dict[str, Any]
    eager: Any  # the model's own eager attention: what transformers falls back to when no other is registered
    ops: Any = None  # torch.ops.cbgen_kernels when its compiled operators serve this layer (`compiled_ops`)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
        if self.ops is not None:
            return self.compiled_forward(hidden_states, attention_mask, position_ids, position_embeddings, **kwargs)
        layer = self.layer
        attn = layer.self_attn
        shape = hidden_states.shape[:-1]
        qkv = self.qkv(rms_norm(hidden_states, layer.input_layernorm))
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        cos, sin = position_embeddings  # type: ignore[misc]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [batch, tokens, 1, dim]
        q_norm = getattr(attn, "q_norm", None)
        if q_norm is None:  # queries and keys rotated in one pass
            qk = rope(qkv[..., : q_size + kv_size].view(*shape, self.heads + self.kv_heads, self.head_dim), cos, sin)
            q, k = qk[..., : self.heads, :], qk[..., self.heads :, :]
        else:
            q = rope(q_norm(qkv[..., :q_size].view(*shape, self.heads, self.head_dim)), cos, sin)
            k = rope(attn.k_norm(qkv[..., q_size : q_size + kv_size].view(*shape, self.kv_heads, self.head_dim)),
                      cos, sin)
        v = qkv[..., q_size + kv_size :].view(*shape, self.kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attn.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, self.eager)
        # position_ids travel on as the stock layer passes them: a sliding-window attention reads where each
        # request's window starts from them
        attended, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                                position_ids=position_ids, **self.window, **kwargs)
        hidden = attn.o_proj(attended.reshape(*shape, -1).contiguous())
        hidden += hidden_states
        gate, up = self.gate_up(rms_norm(hidden, layer.post_attention_layernorm)).split(self.intermediate, dim=-1)
        out = layer.mlp.down_proj(F.silu(gate).mul_(up))
        out += hidden
        return out

    def compiled_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                         position_ids: torch.Tensor | None, position_embeddings: Any, **kwargs: Any) -> torch.Tensor:
        """The same layer with its norms (the residual addition before the second), rotary embedding and SiLU * up
        each one compiled pass over the rows (cbgen/kernels/decoder_ops.cpp), between the same matmuls and attention."""
        layer, ops = self.layer, self.ops
        attn = layer.self_attn
        rows = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
        tokens, dim = rows.shape[0], self.head_dim
        qkv = self.qkv(ops.rms_norm(rows, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon))
        cos, sin = position_embeddings
        ops.rope_(qkv, cos.reshape(tokens, dim), sin.reshape(tokens, dim), self.heads + self.kv_heads, dim)
        q_size, kv_size = self.heads * dim, self.kv_heads * dim
        q = qkv[:, :q_size].view(1, tokens, self.heads, dim).transpose(1, 2)
        k = qkv[:, q_size : q_size + kv_size].view(1, tokens, self.kv_heads, dim).transpose(1, 2)
        v = qkv[:, q_size + kv_size :].view(1, tokens, self.kv_heads, dim).transpose(1, 2)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, self.eager)
        attended, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                                position_ids=position_ids, **self.window, **kwargs)
        hidden = attn.o_proj(attended.reshape(tokens, -1))
        norm = layer.post_attention_layernorm
        out = layer.mlp.down_proj(ops.silu_mul(self.gate_up(ops.add_rms_norm(hidden, rows, norm.weight,
                                                                              norm.variance_epsilon)),
                                               self.intermediate))
        out += hidden
        return out.view(hidden_states.shape)


def _int8(parts: list[Any]) -> bool:
    """Whether the projections are all cbgen's int8 layers (told by their class's own merge methods, so that this
    module needs no import of cbgen.model.int8, which finds the decoder layers here)."""
    return all(hasattr(type(p), "mergeable") and hasattr(type(p), "merged") for p in parts)


def _merged(parts: list[Any]) -> Any:
    """One nn.Linear computing `parts` side by side; each part's weight (and bias) becomes a view of the merged one.
    int8 layers merge their own way (Int8Linear.merged)."""
    if _int8(parts):
        return type(parts[0]).merged(parts)
    with torch.no_grad():
        weight = torch.cat([p.weight for p in parts])
        biases = [p.bias for p in parts]
        bias = torch.cat([b if b is not None else p.weight.new_zeros(p.out_features) for b, p in zip(biases, parts)]) \
            if any(b is not None for b in biases) else None
        merged = torch.nn.Linear(parts[0].in_features, weight.shape[0], bias=bias is not None, device="meta")
        merged.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            merged.bias = torch.nn.Parameter(bias, requires_grad=False)
        start = 0
        for p in parts:
            end = start + p.out_features
            p.weight.data = weight[start:end]
            if p.bias is not None:
                p.bias.data = bias[start:end]  # type: ignore[index]
            start = end
    return merged


def _unmerged(parts: list[Any]) -> None:
    """Each part owns its weights again (a copy of its view), so the merged tensor is freed with its Linear."""
    if _int8(parts):
        type(parts[0]).unmerged(parts)
        return
    with torch.no_grad():
        for p in parts:
            p.weight.data = p.weight.data.clone()
            if p.bias is not None:
                p.bias.data = p.bias.data.clone()


def _groups(layer: Any) -> list[list[torch.nn.Linear]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [[attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device) == (b.data_ptr(), b.shape, b.stride(), b.dtype,
                                                                        b.device)


def _views_of(merged: Any, parts: list[Any]) -> bool:
    """Each part's weight (and bias) is still the view of `merged` it became: nothing replaced or moved them since."""
    if _int8(parts):
        return type(merged) is type(parts[0]) and merged.views_of(parts)
    start = 0
    for p in parts:
        end = start + p.out_features
        if not _same(p.weight, merged.weight[start:end]):
            return False
        if p.bias is not None and (merged.bias is None or not _same(p.bias, merged.bias[start:end])):
            return False
        start = end
    return start == merged.weight.shape[0]


# decoder layer -> its merged (qkv, gate_up) projections: made once per model, the model's own (see the module)
_merges: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Linear, ...]] = weakref.WeakKeyDictionary()
_merges_lock = threading.Lock()


def _merge(layer: Any) -> tuple[torch.nn.Linear, ...]:
    """The layer's merged projections: each group's of an earlier engine while its weights are still their views, else
    merged now."""
    groups = _groups(layer)
    with _merges_lock:
        known = _merges.get(layer) or (None,) * len(groups)
        merged = _merges[layer] = tuple(m if m is not None and _views_of(m, group) else _merged(group)
                                        for m, group in zip(known, groups))
    return merged


def separate(model: torch.nn.Module) -> None:
    """Each projection of the model's decoder layers owns its storage again, and the merge is forgotten (the next
    engine that fuses the layers merges them again)."""
    for layer in decoder_layers(model):
        with _merges_lock:
            merged = _merges.pop(layer, None)
        if merged is not None:
            for group in _groups(layer):
                _unmerged(group)


def _window(layer: Any) -> dict[str, Any]:
    source = FUSED_ARCHITECTURES[type(layer).__name__]
    attn = layer.self_attn
    if source == "config":
        return {"sliding_window": getattr(attn.config, "sliding_window", None)}
    if source == "module":
        return {"sliding_window": getattr(attn, "sliding_window", None)}
    return {}


def _build(layer: Any, ops: Any = None) -> _Fused:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = _merge(layer)
    config = attn.config
    return _Fused(layer, qkv, gate_up, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                  head_dim=attn.head_dim, intermediate=mlp.gate_proj.out_features, window=_window(layer),
                  eager=sys.modules[type(attn).__module__].eager_attention_forward, ops=ops)


def _probe_reason(layer: Any) -> str | None:
    """Why the fused pieces do not compute what this layer's stock ones do (random inputs, the layer's own weights
    and dtype), or None."""
    attn = layer.self_attn
    dtype = layer.input_layernorm.weight.dtype
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, PROBE_ROWS, layer.input_layernorm.weight.shape[0], generator=generator).to(dtype)
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not torch.equal(rms_norm(hidden, norm), norm(hidden)):
                return f"{type(norm).__name__} does not compute Llama's RMSNorm"
        apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if apply is None:
            return "its attention module has no apply_rotary_pos_emb"
        heads, dim = 2, attn.head_dim
        q = torch.randn(1, PROBE_ROWS, heads, dim, generator=generator).to(dtype)
        cos = torch.randn(1, PROBE_ROWS, dim, generator=generator).to(dtype)
        sin = torch.randn(1, PROBE_ROWS, dim, generator=generator).to(dtype)
        expected, _ = apply(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
        if not torch.equal(rope(q, cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2), expected):
            return "its rotary embedding is not Llama's (partial or interleaved rotation)"
        if not torch.equal(F.silu(hidden), layer.mlp.act_fn(hidden)):
            return "its MLP activation does not compute SiLU"
    return None


def unfit_reason(model: torch.nn.Module) -> str | None:
    """Why the model's decoder layers cannot run fused (see the module), or None when they can."""
    from cbgen.attention.support import VALIDATED_TRANSFORMERS, transformers_version

    if transformers_version() not in VALIDATED_TRANSFORMERS:
        return "the fused forward copies transformers' decoder layer, checked only against transformers " + \
            ", ".join(f"{a}.{b}" for a, b in VALIDATED_TRANSFORMERS)
    layers = decoder_layers(model)
    if not layers:
        return "the model has no decoder layers cbgen can find"
    for layer in layers:
        reason = _structure_reason(layer)
        if reason is not None:
            return reason
    if any(p.device.type == "meta" for p in layers[0].parameters()):
        return None  # structure only (planning before weights are loaded)
    return _probe_reason(layers[0])


@contextmanager
def fused_layers(model: torch.nn.Module, ops: Any = None) -> Iterator[MergedLinears]:
    """Every decoder layer of `model` computes through its fused forward while the block runs (the caller checked
    `unfit_reason`; with `ops`, cbgen's compiled operators loaded, cbgen.model.fused_ops.compiled_ops_reason too: the
    layers' norms, rotary and SiLU run as those operators);
    yields the merged linear layers, for the engine's linear kind to be installed on them too. On exit the layers'
    forwards are transformers' again; the projections stay views of the merged weights, for the next engine (see
    the module)."""
    from cbgen.model.linear import replaced_forwards

    built = [_build(layer, ops) for layer in decoder_layers(model)]
    # each layer's forward is its _Fused's bound method: the layer's own arguments, no wrapper in between
    forwards: dict[torch.nn.Module, object] = {fused.layer: fused.forward for fused in built}
    with replaced_forwards(forwards):
        yield MergedLinears(tuple(linear for fused in built for linear in (fused.qkv, fused.gate_up)
                                  if type(linear) is torch.nn.Linear),  # int8 layers keep their own kernel
                            frozenset(id(part) for fused in built for group in _groups(fused.layer) for part in group))
