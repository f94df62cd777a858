"""Qwen2: the Llama decoder with biases on the q/k/v projections only."""

from __future__ import annotations

from typing import Any

from vllm_lite.models.llama import BiasFlags, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 dense models (tied or untied embeddings)."""

    @staticmethod
    def bias_flags(hf_config: Any) -> BiasFlags:
        return BiasFlags(qkv=True, o_proj=False, mlp=False)
