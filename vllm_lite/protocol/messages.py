"""Messages between the frontend (client) and an engine core."""

from __future__ import annotations

import enum

import msgspec

from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.protocol.step import SampleLogprobs


class FinishReason(enum.StrEnum):
    """Why a request ended; the string values are the OpenAI API's."""

    STOP = "stop"  # EOS, a stop token id or (frontend) a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the client or the engine


class EngineCoreRequest(msgspec.Struct, frozen=True):
    """A validated, tokenized request for one engine core."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float


class EngineCoreOutput(msgspec.Struct, frozen=True):
    """New tokens of one request after one engine step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] | None = None
    finish_reason: FinishReason | None = None
    # The token id that stopped the request (EOS or a stop_token_id), if any.
    stop_reason: int | None = None
    # Prompt tokens served from the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
