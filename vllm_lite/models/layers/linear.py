"""Tensor-parallel linear layers (the Megatron split) that own their shard shape and weight loader.

Each layer allocates only this rank's shard; its `weight_loader(param, loaded_weight, shard_id)`
cuts the rank's part out of a full checkpoint tensor. Packed layers (q/k/v, gate/up) run one matmul
over the concatenated weight; `shard_id` says which checkpoint tensor fills which rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vllm_lite.models.layers import gemm
from vllm_lite.models.layers.parallel import SINGLE_RANK, TPContext, all_reduce, divide
from vllm_lite.models.layers.weights import copy_weight, narrow_shard, new_parameter


class LinearBase(nn.Module):
    """`y = x W^T + b` with this rank's weight [out_per_rank, in_per_rank]."""

    def __init__(
        self, in_per_rank: int, out_per_rank: int, bias: bool, tp: TPContext, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = new_parameter((out_per_rank, in_per_rank), dtype, self.weight_loader)
        if bias:
            self.bias = new_parameter((out_per_rank,), dtype, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        # Set by process_weights_after_loading; a derived copy, not a parameter or buffer.
        self.packed_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """Prepare the loaded weight for the fast matmul path (oneDNN packing on CPU fp32)."""
        self.packed_weight = gemm.prepack(self.weight)
        if self.packed_weight is not None:
            gemm.drop_original(self)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight, self.bias, self.packed_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication (the next layer consumes the shard)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPContext = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, divide(output_size, tp.size, "output_size"), bias, tp, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        rows = param.shape[0]
        src = narrow_shard(loaded_weight, 0, self.tp.rank, rows, rows * self.tp.size, "column-parallel")
        copy_weight(param.data, src)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs packed into one matmul (gate_proj + up_proj: shard ids 0, 1)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        tp: TPContext = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.sizes_per_rank = [divide(size, tp.size, "output_size") for size in output_sizes]
        super().__init__(input_size, sum(self.sizes_per_rank), bias, tp, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.sizes_per_rank):
            raise ValueError(f"MergedColumnParallelLinear: bad shard id {shard_id!r}")
        rows = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        full = rows * self.tp.size
        src = narrow_shard(loaded_weight, 0, self.tp.rank, rows, full, f"merged shard {shard_id}")
        copy_weight(param.data.narrow(0, offset, rows), src, f"merged shard {shard_id}")


class QKVParallelLinear(LinearBase):
    """q, k and v projections packed into one matmul, split by heads across ranks.

    With fewer KV heads than ranks (GQA), each KV head is replicated on `tp.size / num_kv_heads`
    ranks, as in vLLM. Rows of this rank's weight: [q heads | k heads | v heads].
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp: TPContext = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp.size, "num_attention_heads")
        if tp.size >= total_num_kv_heads:
            self.kv_replicas = divide(tp.size, total_num_kv_heads, "tp_size (as a multiple of KV heads)")
            self.num_kv_heads = 1
        else:
            self.kv_replicas = 1
            self.num_kv_heads = divide(total_num_kv_heads, tp.size, "num_key_value_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, tp, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id == "q":
            offset, rows, src_index = 0, self.q_size, self.tp.rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rows, src_index = self.kv_size, self.tp.rank // self.kv_replicas
        else:
            raise ValueError(f"QKVParallelLinear: bad shard id {shard_id!r}")
        full = rows * (self.tp.size if shard_id == "q" else self.tp.size // self.kv_replicas)
        src = narrow_shard(loaded_weight, 0, src_index, rows, full, f"{shard_id}_proj")
        copy_weight(param.data.narrow(0, offset, rows), src, f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPContext = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(divide(input_size, tp.size, "input_size"), output_size, bias, tp, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # the bias is replicated, and added once (rank 0) before the reduce
            copy_weight(param.data, loaded_weight, "bias")
            return
        cols = param.shape[1]
        src = narrow_shard(loaded_weight, 1, self.tp.rank, cols, cols * self.tp.size, "row-parallel")
        copy_weight(param.data, src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return all_reduce(gemm.linear(x, self.weight, bias, self.packed_weight), self.tp)
