"""float32 linear layers through oneDNN on CPU (`--onednn-linear`), an opt-in alternative to torch's default matmul.

torch computes a float32 `nn.Linear` on CPU with MKL's sgemm. On a 2-core AMD EPYC (AVX2), MKL reached 36 GFLOP/s
on the vocabulary projection of a 64-sequence decode step (64 x 576 x 49,152) where oneDNN, given the weights
prepacked once into its own layout, reached 101; the MLP projections gained 1.2-1.5x at 1,024 rows. A whole job
(64 x (128 prompt + 64 new) tokens, the embedded SmolLM2-135M) ran 1.06-1.22x faster in three paired runs (cbgen
bench, cbgen run, the engine alone), with the same greedy tokens for all 64 requests; cbgen bench's mixed workload
1.17x (README "Against llama.cpp on an AVX2 CPU").

Two properties differ from the default, which is why it is not: the prepacked weights are a second copy (the
parameters stay, for tied embeddings and saving), and the sums run in another order than MKL's, so logits differ in
the last bits and a greedy token can flip at a near-tie. In exchange each row's result no longer depends on how many
rows share the matmul (measured: bitwise the same for 1 to 1,024 rows; MKL's are not), so a request's tokens do not
depend on which requests were batched with it.
"""

from __future__ import annotations

import types

import torch

PACK_ROWS = 64  # the batch-size hint oneDNN packs for: a decode step's rows; results do not depend on it


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, self.weight, self.bias)  # anything else: the stock path
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, self._cbgen_packed, self.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Runs every float32 CPU `nn.Linear` of `model` through oneDNN with prepacked weights; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype != torch.float32:
            continue
        if module.weight.device.type != "cpu":
            continue
        with torch.no_grad():
            module._cbgen_packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS)
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count


def uses_onednn_linear(model: torch.nn.Module) -> bool:
    return any(hasattr(module, "_cbgen_packed") for module in model.modules())
