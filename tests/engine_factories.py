"""Factories for scheduler / KV-cache tests: requests, a scheduler on a fake KV budget, a fake runner.

`FakeRunner` mirrors the real model runner's bookkeeping without a model: it keeps per-request
state built from `NewRequestData` / `CachedRequestData`, drops finished and preempted requests,
"computes" each scheduled token by writing its token id into a simulated paged KV cache, checks
that every earlier position it would attend to holds the right token (so a wrong prefix-cache hit
or a reused block shows up), and samples exactly the requests whose known tokens are all computed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.engine_core.request import Request
from vllm_lite.engine_core.scheduler import Scheduler
from vllm_lite.protocol.messages import EngineCoreOutput, FinishReason
from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.protocol.step import ModelRunnerOutput, SampleLogprobs, SchedulerOutput

EOS = 2
DEFAULT_TOKEN_BASE = 1000  # default sampled tokens are 1000, 1001, ... (never EOS)
_arrival = itertools.count()


def make_request(
    req_id: str,
    prompt: list[int] | int,
    *,
    max_model_len: int = 64,
    eos_token_ids: tuple[int, ...] = (EOS,),
    **sampling_kwargs: object,
) -> Request:
    """A request; `prompt` is a token list or a length. max_tokens defaults to 8.

    A prompt given as a length gets tokens no other request has, so that a block wrongly shared
    between two requests is caught by the fake runner's KV check.
    """
    arrival = next(_arrival)
    if isinstance(prompt, int):
        prompt = [100_000 * (arrival + 1) + i for i in range(prompt)]
    sampling_kwargs.setdefault("max_tokens", 8)
    return Request(
        req_id,
        prompt,
        SamplingParams(**sampling_kwargs),
        sampling_seed=0,
        eos_token_ids=eos_token_ids,
        arrival_time=float(arrival),
        max_model_len=max_model_len,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    """A scheduler over a fake KV budget of `num_blocks` blocks."""
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


@dataclass
class _RunnerRequest:
    tokens: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams


@dataclass
class FakeRunner:
    """A model runner without a model; `scripts[req_id]` lists the output tokens to sample in order."""

    block_size: int
    scripts: dict[str, list[int]] = field(default_factory=dict)
    requests: dict[str, _RunnerRequest] = field(default_factory=dict)
    # Simulated KV cache: (block id, slot) -> token id written there.
    kv: dict[tuple[int, int], int] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in [*out.finished_req_ids, *out.preempted_req_ids]:
            del self.requests[req_id]
        for new in out.new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent twice"
            self.requests[new.req_id] = _RunnerRequest(
                tokens=[*new.prompt_token_ids, *new.output_token_ids],
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=new.sampling_params,
            )
        for cached in out.cached_reqs:
            state = self.requests[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens, cached.req_id
            state.block_ids.extend(cached.new_block_ids)
        scheduled_ids = {r.req_id for r in out.new_reqs} | {r.req_id for r in out.cached_reqs}
        assert set(out.num_scheduled_tokens) == scheduled_ids
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

        # Attention reads every earlier position: check them all before this step writes anything.
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            end = state.num_computed_tokens + num_tokens
            assert num_tokens > 0 and end <= len(state.tokens), (req_id, num_tokens)
            assert len(state.block_ids) * self.block_size >= end, f"{req_id}: block table too short"
            for pos in range(state.num_computed_tokens):
                assert self.kv.get(self._slot(state, pos)) == state.tokens[pos], f"{req_id}: bad KV at {pos}"

        req_ids, sampled, logprobs = [], [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            for pos in range(state.num_computed_tokens, state.num_computed_tokens + num_tokens):
                self.kv[self._slot(state, pos)] = state.tokens[pos]
            state.num_computed_tokens += num_tokens
            if state.num_computed_tokens < len(state.tokens):
                continue  # mid-prefill chunk: no logits to sample from
            token = self._next_token(req_id, state)
            state.tokens.append(token)
            req_ids.append(req_id)
            sampled.append(token)
            wants_logprobs = state.sampling_params.logprobs is not None
            logprobs.append(SampleLogprobs(token, -0.5, 1, [token], [-0.5]) if wants_logprobs else None)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs)

    def _slot(self, state: _RunnerRequest, pos: int) -> tuple[int, int]:
        return state.block_ids[pos // self.block_size], pos % self.block_size

    def _next_token(self, req_id: str, state: _RunnerRequest) -> int:
        index = len(state.tokens) - state.num_prompt_tokens
        script = self.scripts.get(req_id, [])
        return script[index] if index < len(script) else DEFAULT_TOKEN_BASE + index


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step (schedule -> execute -> update), checking runner and scheduler agree after it."""
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, runner.execute(out))
    for request in scheduler.running:
        state = runner.requests[request.req_id]
        assert state.block_ids == scheduler.kv_cache_manager.get_block_ids(request.req_id)
        assert state.tokens[: request.num_tokens] == request.all_token_ids
    return out, outputs


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500) -> RunResult:
    """Step until no request is left; every request's KV blocks must be back in the free pool."""
    result = RunResult()
    free_at_start = scheduler.kv_cache_manager.num_blocks
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out, outputs = step(scheduler, runner)
        result.steps.append(out)
        for output in outputs:
            result.tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
            result.outputs.setdefault(output.req_id, []).append(output)
            if output.finished:
                result.finish_reasons[output.req_id] = output.finish_reason
    else:
        raise AssertionError(f"not finished after {max_steps} steps: {scheduler.running} {scheduler.waiting}")
    assert scheduler.kv_cache_manager.num_free_blocks == free_at_start
    return result
