"""Vocabulary-parallel token embedding and LM head.

Rank r owns rows [r * per_rank, (r + 1) * per_rank) of the vocabulary, where per_rank rounds up;
rows past the real vocabulary are zero padding. The embedding masks out-of-shard ids and sums the
ranks' partial lookups; the head gathers the ranks' logit slices and trims the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.models.layers import gemm
from vllm_lite.models.layers.parallel import SINGLE_RANK, TPContext, all_gather_last_dim, all_reduce
from vllm_lite.models.layers.weights import copy_weight, new_parameter


class VocabParallelEmbedding(nn.Module):
    """Token id -> embedding, with the vocabulary sharded across TP ranks."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPContext = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = min(tp.rank * per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        self.weight = new_parameter((per_rank, embedding_dim), dtype, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"embedding: checkpoint has {loaded_weight.shape[0]} rows, config vocab_size is "
                f"{self.num_embeddings}"
            )
        rows = self.vocab_end - self.vocab_start
        copy_weight(param.data[:rows], loaded_weight[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary; may share its weight with the embedding (tied)."""

    packed_weight: torch.Tensor | None = None
    # Set by the model when the head shares the embedding's weight (which must then stay).
    tied = False

    def process_weights_after_loading(self) -> None:
        """Pack the weight for the fast matmul path; an untied head drops its original copy."""
        self.packed_weight = gemm.prepack(self.weight)
        if self.packed_weight is not None and not self.tied:
            gemm.drop_original(self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = gemm.linear(hidden_states, self.weight, None, self.packed_weight)
        if self.tp.size == 1:
            return logits
        return all_gather_last_dim(logits, self.tp)[..., : self.num_embeddings]
