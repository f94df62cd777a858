"""Helpers shared by the layers' weight loaders."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

WeightLoader = Callable[..., None]


def copy_weight(dst: torch.Tensor, src: torch.Tensor, name: str = "weight") -> None:
    """Copy a checkpoint tensor into (a slice of) a parameter, casting dtype and device.

    The shape check is what turns a wrong config or a wrong shard into a clear error instead of a
    broadcast or a silently garbled model.
    """
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Loader of replicated, unpacked parameters (norm weights, ...)."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter got shard id {shard_id!r}")
    copy_weight(param.data, loaded_weight)


def new_parameter(shape: tuple[int, ...], dtype: torch.dtype | None, loader: WeightLoader) -> nn.Parameter:
    """An uninitialised inference parameter that carries its weight loader."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param
