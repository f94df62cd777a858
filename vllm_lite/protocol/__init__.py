"""The wire: msgspec Structs for every message; no pickle anywhere. Imports no other package part."""

from vllm_lite.protocol.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
