"""One request's state inside an engine core, shared by the scheduler and the KV-cache manager.

A `Request` is the single object passed between the scheduler and the KV-cache manager (nano-vllm's
`Sequence`, vLLM's `Request`). Only the engine core mutates it; the model runner keeps its own copy
of what it needs, built from `NewRequestData` / `CachedRequestData`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from vllm_lite.protocol.messages import EngineCoreRequest, FinishReason
from vllm_lite.protocol.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life; the FINISHED_* members are terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, its KV blocks freed (recompute later)
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """A prompt, its generated tokens and how far its KV cache has been computed.

    `num_computed_tokens` counts the leading tokens of `all_token_ids` whose KV is in the cache;
    the tokens still to compute are `num_tokens - num_computed_tokens` (a prefill chunk, or 1 for a
    decode). That single number replaces any notion of prefill and decode phases.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        sampling_seed: int,
        eos_token_ids: Sequence[int],
        arrival_time: float,
        max_model_len: int,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.sampling_seed = sampling_seed
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.arrival_time = arrival_time
        self.max_model_len = max_model_len

        self.output_token_ids: list[int] = []
        # Prompt followed by outputs, kept in step with `output_token_ids` so that reading it
        # (block hashing, NewRequestData) does not copy.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        # Prompt tokens served by the prefix cache when the request was first scheduled.
        self.num_cached_tokens = 0
        # Seconds between reaching the engine and first being scheduled; reported once.
        self.received_time = time.monotonic()
        self.queue_time_s: float | None = None
        self.queue_time_reported = False
        # The token (EOS or a stop_token_id) that ended the request, if any.
        self.stop_reason: int | None = None
        # Content hashes of the request's full blocks, filled in by the KV-cache manager. Tokens
        # are only ever appended, so a full block's hash never changes and is computed once.
        self.block_hashes: list[bytes] = []

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        *,
        sampling_seed: int,
        eos_token_ids: Sequence[int],
        max_model_len: int,
    ) -> Request:
        """Build the engine-side state of a request received from the frontend."""
        return cls(
            request.req_id,
            request.prompt_token_ids,
            request.sampling_params,
            sampling_seed=sampling_seed,
            eos_token_ids=eos_token_ids,
            arrival_time=request.arrival_time,
            max_model_len=max_model_len,
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids (read-only view; use `append_output_token` to grow it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """Most output tokens allowed: the user's max_tokens, capped by what max_model_len leaves."""
        room = self.max_model_len - self.num_prompt_tokens
        if self.sampling_params.max_tokens is None:
            return room
        return min(self.sampling_params.max_tokens, room)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
