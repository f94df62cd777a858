"""Model classes keyed by the HF `architectures` name in a checkpoint's config."""

from __future__ import annotations

from torch import nn

from vllm_lite.models.llama import LlamaForCausalLM
from vllm_lite.models.qwen2 import Qwen2ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral's dense models are Llama with (optionally) a sliding window, which llama.py checks.
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def supported_architectures() -> list[str]:
    """The HF architecture names vllm-lite can run."""
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for a HF architecture name; ValueError naming the supported ones otherwise."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        ) from None
