"""Weight loading: the shared parameter loaders and the loop that streams a checkpoint into a model."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

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


def narrow_shard(
    loaded_weight: torch.Tensor, dim: int, index: int, size: int, full: int, name: str
) -> torch.Tensor:
    """Shard `index` (of `size` along `dim`) of a checkpoint tensor that must be `full` long there."""
    if loaded_weight.dim() <= dim or loaded_weight.shape[dim] != full:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(loaded_weight.shape)}, expected {full} along dim {dim}"
        )
    return loaded_weight.narrow(dim, index * size, size)


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


def _resolve(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """Checkpoint name -> (our parameter name, shard id): `...q_proj.weight` -> `...qkv_proj.weight`, 'q'."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in packed:
        target, shard_id = packed[parts[-2]]
        return ".".join([*parts[:-2], target, parts[-1]]), shard_id
    return name, None


def checkpoint_names(model: nn.Module, packed: dict[str, tuple[str, object]]) -> list[str]:
    """The checkpoint tensor names that fill `model`'s parameters (packed ones expanded)."""
    by_target: dict[str, list[str]] = {}
    for source, (target, _) in packed.items():
        by_target.setdefault(target, []).append(source)
    names = []
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parent, _, local = module.rpartition(".")
        prefix = f"{parent}." if parent else ""
        names += [f"{prefix}{source}.{leaf}" for source in by_target.get(local, [local])]
    return names


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: dict[str, tuple[str, object]],
    skip: Collection[str] = (),
) -> None:
    """Stream checkpoint tensors into `model` through each parameter's weight loader.

    `packed` maps a checkpoint module name to (our packed module, shard id). Every parameter (every
    shard of a packed one) must be filled exactly once and every tensor must be used, except those
    named in `skip` and rotary `inv_freq` buffers, or this raises ValueError.
    """
    params = dict(model.named_parameters())
    expected = {name: set() for name in params}
    for name in checkpoint_names(model, packed):
        param_name, shard_id = _resolve(name, packed)
        expected[param_name].add(shard_id)
    loaded: dict[str, set] = {name: set() for name in params}
    unexpected = []
    for name, tensor in weights:
        if name in skip or name.endswith("rotary_emb.inv_freq"):
            continue
        param_name, shard_id = _resolve(name, packed)
        param = params.get(param_name)
        if param is None or shard_id not in expected[param_name]:
            unexpected.append(name)
            continue
        if shard_id in loaded[param_name]:
            raise ValueError(f"checkpoint tensor {name} appears twice")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(f"checkpoint tensor {name}: {exc}") from None
        loaded[param_name].add(shard_id)
    missing = sorted(f"{n}[{s}]" if s is not None else n for n in params for s in expected[n] - loaded[n])
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match the model: missing {_preview(missing)}; "
            f"unexpected {_preview(sorted(unexpected))}"
        )


def _preview(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
