"""Transparent huge pages for large CPU buffers (Linux `madvise(MADV_HUGEPAGE)`).

Where THP is in `madvise` mode (a common default), only regions that ask get 2 MiB pages. Large
tensors read at random offsets every step (the KV cache) are TLB-bound on 4 KiB pages. The advice
must come before the pages are first touched. Elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

_MADV_HUGEPAGE = 14
_PAGE = 4096
_MIN_BYTES = 4 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def advise(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under a large, not yet touched CPU tensor; True if the kernel agreed."""
    nbytes = tensor.numel() * tensor.element_size()
    libc = _libc()
    if libc is None or nbytes < _MIN_BYTES:
        return False
    start = (tensor.data_ptr() + _PAGE - 1) // _PAGE * _PAGE
    end = (tensor.data_ptr() + nbytes) // _PAGE * _PAGE
    return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
