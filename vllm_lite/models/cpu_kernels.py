"""Native CPU kernels, compiled on first use with torch's C++ extension builder and cached.

Only a fast path: where the compiler is missing or the build fails, callers fall back to plain
torch code that computes the same thing (and that is the path CUDA takes).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    os.path.join(os.path.dirname(__file__), "csrc", name)
    for name in ("paged_attention_cpu.cpp", "elementwise_cpu.cpp")
]
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _build_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(root, "vllm_lite", f"torch-{torch.__version__}")
    os.makedirs(path, exist_ok=True)
    return path


def load() -> bool:
    """Build (once per machine) and load the kernels; False when they cannot be had."""
    with _lock:
        if "loaded" not in _state:
            try:
                from torch.utils.cpp_extension import load as load_extension

                load_extension(
                    name="vllm_lite_cpu_kernels",
                    sources=_SOURCES,
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=_build_dir(),
                    is_python_module=False,
                    verbose=False,
                )
                _state["loaded"] = True
            except Exception as exc:  # no compiler, no headers, ...: the torch path still works
                logger.warning("native CPU attention kernel unavailable, using the torch path: %s", exc)
                _state["loaded"] = False
        return _state["loaded"]


def supports(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the native decode kernel handles these shapes, dtype and device."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or not load():
        return False
    block_size, head_dim, group = key_cache.shape[-1], q.shape[-1], q.shape[1] // key_cache.shape[1]
    return bool(torch.ops.vllm_lite.paged_decode_supported(block_size, head_dim, group))


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Single-token attention for a batch of requests, read through their block tables."""
    return torch.ops.vllm_lite.paged_decode(q, key_cache, value_cache, block_tables, context_lens, scale)


def supports_elementwise(x: torch.Tensor) -> bool:
    """Whether the fused norm / rotary kernels handle this activation tensor."""
    return (
        x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and load()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), per row."""
    return torch.ops.vllm_lite.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual in place; returns weight * x / rms(x)."""
    return torch.ops.vllm_lite.add_rms_norm(x, residual, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, heads * head_dim] with cos/sin [T, head_dim / 2]."""
    return torch.ops.vllm_lite.rotary(x, cos, sin, head_dim)
