"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from vllm_lite.models import cpu_kernels
from vllm_lite.models.layers.weights import default_weight_loader, new_parameter


class RMSNorm(nn.Module):
    """HF Llama's RMSNorm (statistics in fp32, weight applied in the input dtype).

    `forward(x)` returns the normed x. `forward(x, residual)` first adds x into the residual stream
    and returns (normed sum, sum): the decoder layer then needs no separate add. The sum is written
    into `x` in place, so x must be a temporary the caller no longer needs (a sublayer's output).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.supports_elementwise(x):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        if cpu_kernels.supports_elementwise(x) and x.is_contiguous() and residual.is_contiguous():
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps), x
        x = x.add_(residual)
        return self._norm(x), x
