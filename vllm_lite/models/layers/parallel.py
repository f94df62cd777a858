"""Tensor-parallel identity and the two collectives the TP layers need.

There is no global TP state: every layer receives the `TPContext` of its rank at construction. With
`size == 1` the collectives return their input untouched, so single-rank runs never touch
torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    """This rank's place in its tensor-parallel group (`group` is a torch.distributed ProcessGroup)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid TP rank/size: rank={self.rank}, size={self.size}")


SINGLE_RANK = TPContext()  # the default: no tensor parallelism (frozen, so one shared instance is safe)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact division, with an error that names the quantity that does not split evenly."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the TP size {denominator}")
    return numerator // denominator


def all_reduce(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Sum `x` over the TP group, in place; a no-op on a single rank."""
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension (rank order); identity on one rank."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)
