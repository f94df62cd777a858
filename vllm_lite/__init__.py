"""vllm-lite: a data-parallel LLM serving engine (paged KV cache, continuous batching)."""

from vllm_lite.config import EngineArgs
from vllm_lite.protocol.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncEngineClient",
    "EngineArgs",
    "EngineDeadError",
    "RequestError",
    "SamplingParams",
    "RequestOutputKind",
    "__version__",
]

from vllm_lite.errors import EngineDeadError, RequestError  # noqa: E402
from vllm_lite.protocol.sampling_params import RequestOutputKind  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch and the model code, the client zmq and transformers: load them on demand.
    if name == "LLM":
        from vllm_lite.engine_core.llm import LLM

        return LLM
    if name == "AsyncEngineClient":
        from vllm_lite.frontend.client import AsyncEngineClient

        return AsyncEngineClient
    raise AttributeError(name)
