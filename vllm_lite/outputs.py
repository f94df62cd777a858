"""What the offline `LLM` and the client hand back to users."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_lite.protocol.step import SampleLogprobs


@dataclass
class CompletionOutput:
    """One generated sequence (there are `n` per request)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampleLogprobs] | None = None


@dataclass
class RequestOutput:
    """A request's prompt and its generated sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # True on the last output of a request (all of its n sequences have ended).
    finished: bool = False
