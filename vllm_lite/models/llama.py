"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral-style), written on the TP layers.

One step's tokens are a flat [T] batch; the paged `Attention` layer finds each request's context
through the `AttentionMetadata`. Qwen2 reuses this code with different bias flags (qwen2.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_lite.models.attention import Attention, AttentionMetadata
from vllm_lite.models.layers import (
    SINGLE_RANK,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    TPContext,
    VocabParallelEmbedding,
    apply_rotary,
    get_rope,
)
from vllm_lite.models.layers.weights import checkpoint_names, load_packed_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BiasFlags:
    """Which projections carry a bias; the only structural difference between Llama and Qwen2."""

    qkv: bool
    o_proj: bool
    mlp: bool


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, bias: BiasFlags, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim_of(hf_config)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size, self.head_dim, num_heads, num_kv_heads, bias.qkv, tp, dtype
        )
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, hf_config.hidden_size, bias.o_proj, tp, dtype
        )
        self.split_sizes = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.attn = Attention(
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        # Rotation writes fresh contiguous q and k (the decode kernel wants contiguous q); v stays a view.
        q = apply_rotary(q, *rope, self.head_dim)
        k = apply_rotary(k, *rope, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config: Any, bias: BiasFlags, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act={act!r} (only silu is supported)")
        size = hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hf_config.hidden_size, [size, size], bias.mlp, tp, dtype
        )
        self.down_proj = RowParallelLinear(size, hf_config.hidden_size, bias.mlp, tp, dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, bias: BiasFlags, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, bias, tp, dtype)
        self.mlp = LlamaMLP(hf_config, bias, tp, dtype)
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer output, residual stream so far): the add happens inside the next norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self, hf_config: Any, bias: BiasFlags, tp: TPContext, dtype: torch.dtype, max_positions: int
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, bias, tp, dtype) for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        self.rotary_emb = get_rope(hf_config, head_dim_of(hf_config), max_positions)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)  # gathered once, shared by every layer
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache; parameter names follow the HF checkpoint."""

    # checkpoint name -> (our packed parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def bias_flags(hf_config: Any) -> BiasFlags:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return BiasFlags(
            qkv=attention_bias, o_proj=attention_bias, mlp=bool(getattr(hf_config, "mlp_bias", False))
        )

    def __init__(
        self,
        hf_config: Any,
        tp: TPContext = SINGLE_RANK,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
    ) -> None:
        """Allocate (uninitialised) weights on `device`; `max_model_len` sizes the rotary tables."""
        super().__init__()
        self.config = hf_config
        max_positions = max_model_len or hf_config.max_position_embeddings
        _check_sliding_window(hf_config, max_positions)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        with torch.device(device):
            self.model = LlamaModel(hf_config, self.bias_flags(hf_config), tp, dtype, max_positions)
            # A tied head is built on the meta device (no memory) and then shares the embedding.
            with torch.device("meta" if self.tie_word_embeddings else device):
                self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp, dtype)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
                self.lm_head.tied = True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 (the step's flat batch) -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] (the rows to sample from) -> [N, vocab] float32 logits."""
        return self.lm_head(hidden_states).float()

    def attention_layers(self) -> list[Attention]:
        """Every layer's paged attention, in layer order, for the runner to bind `kv_cache`."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_weight_names(self) -> list[str]:
        """The HF checkpoint tensor names this model loads (packed parameters expanded)."""
        return checkpoint_names(self, self.packed_modules_mapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises on missing or unexpected ones."""
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        load_packed_weights(self, weights, self.packed_modules_mapping, skip)


def _check_sliding_window(hf_config: Any, max_positions: int) -> None:
    """Sliding-window attention equals full attention while sequences fit in the window."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if window is None:
        return
    if window < max_positions:
        raise NotImplementedError(
            f"sliding-window attention (window {window}) is not supported; "
            f"set max_model_len <= {window} to run this model with full attention"
        )
    logger.warning("ignoring sliding_window=%d: it is >= max_model_len=%d", window, max_positions)
