"""The matmul behind every linear layer and the LM head.

On CPU in fp32, weights are reordered once after loading into oneDNN's blocked layout, and each
call runs oneDNN's packed GEMM: measured here at ~200 GFLOP/s for the skinny shapes of decoding
(64 x 576 x 1536) where `F.linear` reaches 100-150, and twice as fast on the LM head. Everywhere
else (CUDA, bf16, no oneDNN) it is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its blocking from an expected batch size; any batch size still computes correctly.
_BATCH_HINT = 64


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether `prepack` applies to this weight (CPU, fp32, oneDNN available)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-packed copy of a [out, in] weight, or None where the plain path is used."""
    if not can_prepack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def drop_original(module: nn.Module) -> None:
    """Replace `module.weight` by a shape-only (meta) parameter once its packed copy exists.

    The packed copy is the only one used from then on; keeping both would double the memory of
    every weight. Shape, dtype and parameter counts stay visible; loading weights again is not
    supported after this.
    """
    weight = module.weight
    meta = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
    module.weight = nn.Parameter(meta, requires_grad=False)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """`x W^T + b`, through the packed weight when there is one."""
    if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
