"""Native CPU kernels, compiled on first use with torch's C++ extension builder and cached.

Only a fast path: where the compiler is missing or the build fails, callers fall back to plain
torch code that computes the same thing (and that is the path CUDA takes).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCE_NAMES = ("paged_attention_cpu.cpp", "elementwise_cpu.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_signature() -> str:
    """The first CPU's model and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(lines[:2])
    except OSError:
        return os.uname().machine


def _prepare_build_dir() -> list[str]:
    """Copy the sources into a build directory named by their hash; return the copies' paths.

    Many processes load these kernels at once (TP workers, DP ranks, tests), possibly from
    different checkouts. Keyed by content and always built from the same paths, a directory's
    build.ninja never changes (per torch install), so once built nobody rebuilds (and rewrites) a library another
    process may be loading; torch's file lock serialises the first build.
    """
    sources = {name: open(os.path.join(_SOURCE_DIR, name), "rb").read() for name in _SOURCE_NAMES}
    # -march=native: a library built on one CPU may not run on another sharing this home directory.
    # The torch install path too: build.ninja names its include and library directories, so two
    # virtual environments sharing one directory would rebuild it under each other's feet.
    key = (torch.__version__, os.path.dirname(torch.__file__), _CFLAGS, _LDFLAGS, _cpu_signature())
    digest = hashlib.sha256(repr(key).encode())
    for name, text in sources.items():
        digest.update(name.encode() + text)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    build_dir = os.path.join(root, "vllm_lite", f"kernels-{digest.hexdigest()[:16]}")
    os.makedirs(build_dir, exist_ok=True)
    paths = []
    for name, text in sources.items():
        path = os.path.join(build_dir, name)
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(text)
            os.replace(tmp, path)  # atomic: a concurrent loader never sees half a file
        paths.append(path)
    return paths


def load() -> bool:
    """Build (once per machine) and load the kernels; False when they cannot be had."""
    loaded = _state.get("loaded")
    if loaded is not None:  # the hot path: asked several times per layer and step
        return loaded
    with _lock:
        if "loaded" not in _state:
            try:
                from torch.utils.cpp_extension import load as load_extension

                sources = _prepare_build_dir()
                load_extension(
                    name="vllm_lite_cpu_kernels",
                    sources=sources,
                    extra_cflags=_CFLAGS,
                    extra_ldflags=_LDFLAGS,
                    build_directory=os.path.dirname(sources[0]),
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
    return _decode_shape_supported(key_cache.shape[-1], q.shape[-1], q.shape[1] // key_cache.shape[1])


@functools.cache
def _decode_shape_supported(block_size: int, head_dim: int, group: int) -> bool:
    # Asked once per layer per step with the same few shapes: remember the kernel's answer.
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
