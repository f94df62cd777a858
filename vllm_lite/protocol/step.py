"""Messages between the engine core and its model runner(s): one step's work and its result.

The scheduler sends differences, not whole objects: a request appears in full once
(`NewRequestData`, again after a preemption), later only as a delta (`CachedRequestData`).
The model runner keeps the per-request state and appends the tokens it sampled itself. These
are msgspec Structs so that the same message can later travel to TP workers without pickle.
"""

from __future__ import annotations

import msgspec

from vllm_lite.protocol.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, frozen=True):
    """A request the runner has not seen (or has dropped after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; recomputed like prompt tokens, but they still count
    # as output for penalties, min_tokens and the sampling position.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Resolved seed for this request's randomness (the user's seed, or one drawn by the engine).
    sampling_seed: int
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, frozen=True):
    """A request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct, frozen=True):
    """One step: which requests run and how many new tokens each computes."""

    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step (prefill chunk, or 1 for decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget before this step (finished or aborted since the last one).
    finished_req_ids: list[str]
    # Requests preempted this step (their blocks are freed); they come back as NewRequestData.
    preempted_req_ids: list[str]


class SampleLogprobs(msgspec.Struct, frozen=True):
    """Log-probability of one sampled token and the top-N alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the distribution
    top_token_ids: list[int]
    top_logprobs: list[float]


class ModelRunnerOutput(msgspec.Struct, frozen=True):
    """Tokens sampled in one step, one per request whose known tokens are all computed now."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    # One entry per sampled request, None for requests that did not ask for logprobs.
    logprobs: list[SampleLogprobs | None]
