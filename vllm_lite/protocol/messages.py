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


class EngineCoreRequest(msgspec.Struct, frozen=True, tag="request"):
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
    # Set when the engine refused or failed this one request (finish_reason is then ABORT); the
    # engine itself keeps serving.
    error: str | None = None
    # On a request's first output: seconds it waited in the engine before first being scheduled.
    queue_time_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreAbort(msgspec.Struct, frozen=True, tag="abort"):
    """Abort these requests (client disconnect, stop string hit, shutdown)."""

    req_ids: list[str]


class UtilityCall(msgspec.Struct, frozen=True, tag="utility"):
    """Call an engine-core method outside the step (stats, reset prefix cache, ...)."""

    call_id: int
    method: str
    args: list[msgspec.Raw] = []


class UtilityResult(msgspec.Struct, frozen=True, tag="utility_result"):
    """The reply to a UtilityCall: a msgpack-encoded result, or an error message."""

    call_id: int
    # msgpack bytes of the return value (msgpack nil by default); msgspec cannot put Raw in a union.
    result: msgspec.Raw = msgspec.Raw(b"\xc0")
    error: str | None = None


class EngineStats(msgspec.Struct, frozen=True):
    """Load figures an engine publishes with its outputs (the DP balancer ranks on them)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Forward passes run so far (dummy ones of DP lockstep included).
    num_steps: int = 0


class EngineCoreOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    """Every new token of one engine step, sent as one frame."""

    engine_index: int
    outputs: list[EngineCoreOutput]
    stats: EngineStats | None = None
    timestamp: float = 0.0

    @property
    def is_heartbeat(self) -> bool:
        """Sent by an idle engine each second: "alive, nothing to say"."""
        return not self.outputs and self.stats is None


class EngineDead(msgspec.Struct, frozen=True, tag="engine_dead"):
    """Sent by an engine core on a fatal error, just before it exits (on the output socket, or on
    the handshake socket when it fails during startup)."""

    engine_index: int
    reason: str


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """Handshake, engine -> frontend: who is connecting."""

    dp_rank: int
    local: bool
    headless: bool
    # DP rank 0 only (DP size > 1): the port its DP-group store bound, for the other ranks.
    dp_master_port: int = 0


class HandshakeAddresses(msgspec.Struct, frozen=True, tag="addresses"):
    """Handshake, frontend -> engine: where to connect the data sockets."""

    input_address: str
    output_address: str
    # Where the DP group's store is (rank 0's address and the port it published); DP size > 1.
    dp_master_ip: str = "127.0.0.1"
    dp_master_port: int = 0


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Handshake, engine -> frontend: what the client must know about this engine."""

    dp_rank: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    version: str
    config_hash: str


# Every top-level message, by direction: a decoder accepts exactly one of these unions.
ToEngine = EngineCoreRequest | EngineCoreAbort | UtilityCall
FromEngine = EngineCoreOutputs | UtilityResult | EngineDead
HandshakeToFrontend = Hello | Ready | EngineDead
HandshakeToEngine = HandshakeAddresses
