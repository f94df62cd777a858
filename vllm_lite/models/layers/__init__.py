"""Model building blocks: tensor-parallel linear/embedding layers, norms, activations, rotary."""

from vllm_lite.models.layers.activation import SiluAndMul
from vllm_lite.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vllm_lite.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm_lite.models.layers.norm import RMSNorm
from vllm_lite.models.layers.parallel import SINGLE_RANK, TPContext
from vllm_lite.models.layers.rotary import RotaryEmbedding, apply_rotary, get_rope
from vllm_lite.models.layers.weights import default_weight_loader

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SINGLE_RANK",
    "SiluAndMul",
    "TPContext",
    "VocabParallelEmbedding",
    "apply_rotary",
    "default_weight_loader",
    "get_rope",
]
