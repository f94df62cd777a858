"""vllm-lite: a data-parallel LLM serving engine (paged KV cache, continuous batching)."""

from vllm_lite.config import EngineArgs
from vllm_lite.protocol.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "EngineArgs", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; load it only when asked for.
    if name == "LLM":
        from vllm_lite.engine_core.llm import LLM

        return LLM
    raise AttributeError(name)
