"""Rotary position embeddings, numerically matching HF transformers (neox / rotate_half style).

cos and sin are precomputed once for every position in fp32, exactly as HF computes them on the fly
(`position * inv_freq`, then cos/sin), so a step only gathers rows by position.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from vllm_lite.models import cpu_kernels

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings as one flat dict with `rope_type` and `rope_theta`.

    transformers 5 configs carry `rope_parameters`; older configs carry `rope_theta` and an optional
    `rope_scaling` dict (whose type key may be `type` instead of `rope_type`).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    else:
        params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def compute_inv_freq(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with the same ops (and rounding) as HF's init fns."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings are not supported")
    base = params["rope_theta"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq /= params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    # "dynamic" (NTK) only changes the base past max_position_embeddings, which max_model_len never
    # exceeds, so within the supported range it is the default rope (see get_rope).
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed down, short ones kept."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions); `forward(positions)` gathers the step's rows."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        self.max_positions = max_positions
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim / 2] in `dtype` (HF casts them to the activations' dtype)."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotate x [T, N * head_dim] (any strides) -> a new contiguous [T, N * head_dim] tensor.

    Same result as HF's `x * cos + rotate_half(x) * sin` with cos/sin duplicated over both halves.
    """
    if cpu_kernels.supports_elementwise(x):
        return cpu_kernels.rotary(x, cos.squeeze(1), sin.squeeze(1), head_dim)
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    return out.view(num_tokens, -1)


def get_rope(hf_config: Any, head_dim: int, max_positions: int) -> RotaryEmbedding:
    """The rotary embedding a HF config asks for, with tables for `max_positions` positions."""
    params = rope_parameters(hf_config)
    if params["rope_type"] == "dynamic":
        limit = getattr(hf_config, "max_position_embeddings", max_positions)
        if max_positions > limit:
            raise NotImplementedError(
                f"dynamic NTK rope past max_position_embeddings={limit} (asked for {max_positions})"
            )
    return RotaryEmbedding(compute_inv_freq(params, head_dim), max_positions)
