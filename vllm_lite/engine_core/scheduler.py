"""Continuous-batching scheduler: pure bookkeeping over requests and KV blocks, no tensors.

There are no prefill or decode phases, only tokens to compute (vLLM V1): each request has
`num_tokens - num_computed_tokens` of them, and each step hands out a budget of
`max_num_batched_tokens` first to running requests (FCFS: chunked prefills continue, decodes get
one token), then to waiting ones (FCFS, no skipping), after a prefix-cache lookup. A running
request that cannot get KV blocks preempts the latest-arrived running request (recompute later).

`num_computed_tokens` only moves in `update_from_output`, after the runner computed the tokens:
`schedule()` leaves it at the value the runner sees as the start position of this step, and
blocks are registered in the prefix cache only once their KV really exists. So each `schedule()`
must be followed by `update_from_output()` before the next `schedule()`.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.engine_core.kv_cache_manager import KVCacheManager
from vllm_lite.engine_core.request import Request, RequestStatus
from vllm_lite.protocol.messages import EngineCoreOutput, EngineStats
from vllm_lite.protocol.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SampleLogprobs,
    SchedulerOutput,
)


class Scheduler:
    """Decides each step which requests compute how many tokens, and applies the results."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_kv_blocks: int
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        # A sequence must fit in the model and in the whole KV cache; past that it ends as LENGTH
        # (otherwise a lone request would preempt itself forever).
        self.max_seq_len = min(scheduler_config.max_model_len, num_kv_blocks * cache_config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # Kept in the order requests were added (FCFS), so the last one is the first to preempt
        # and is never a request already scheduled earlier in the same step.
        self.running: list[Request] = []
        self._arrival_order: dict[str, int] = {}
        self._num_added = 0
        # Requests the runner holds state for that ended since the last schedule().
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it is a duplicate or could never be scheduled."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.req_id!r} has an empty prompt")
        # + 1: there must be room for at least one generated token.
        needed = request.num_prompt_tokens + 1
        if needed > self.config.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt of {request.num_prompt_tokens} tokens leaves no room "
                f"for output within max_model_len={self.config.max_model_len}"
            )
        if needed > self.max_seq_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt of {request.num_prompt_tokens} tokens does not fit "
                f"in the KV cache ({self.kv_cache_manager.num_blocks} blocks of {self.block_size} tokens)"
            )
        self.requests[request.req_id] = request
        self._arrival_order[request.req_id] = self._num_added
        self._num_added += 1
        self.waiting.append(request)

    def abort_requests(self, req_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """End the given requests now and free their blocks; unknown or finished ids are ignored."""
        outputs = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(request, [], None))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self) -> EngineStats:
        """A snapshot of the load, as engines publish it (step counts are the engine's own)."""
        kv = self.kv_cache_manager
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating (or preempting for) KV blocks."""
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_block_ids = self._allocate_or_preempt(request, num_new, preempted)
            if new_block_ids is None:  # it preempted itself: it was the last running request
                break
            cached_reqs.append(CachedRequestData(request.req_id, new_block_ids, request.num_computed_tokens))
            num_scheduled[request.req_id] = num_new
            budget -= num_new
            i += 1

        # Requests just preempted would head the queue and thrash; admit nobody this step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_block_ids, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_computed, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_block_ids) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
                request.queue_time_s = time.monotonic() - request.received_time
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: self._arrival_order[r.req_id])
            new_reqs.append(self._new_request_data(request))
            num_scheduled[request.req_id] = num_new
            budget -= num_new

        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=sorted(finished),
            preempted_req_ids=preempted,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, apply stop rules and free finished requests.

        Returns one output per request that got a token. Requests aborted since `schedule()` are
        skipped. The runner samples exactly the requests whose known tokens are all computed after
        the step; a request in the middle of a chunked prefill gets no token.
        """
        kv = self.kv_cache_manager
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_tokens
            kv.cache_full_blocks(request)

        outputs = []
        for req_id, token_id, logprobs in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, runner_output.logprobs, strict=True
        ):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != request.num_tokens:
                raise RuntimeError(
                    f"runner sampled {req_id!r} with {request.num_tokens - request.num_computed_tokens} "
                    "of its tokens not computed yet"
                )
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(self._output(request, [token_id], None if logprobs is None else [logprobs]))
        return outputs

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> list[int] | None:
        """Blocks for `request`, preempting latest arrivals until they fit; None if it was preempted."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.req_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        # Recompute later: drop the KV, keep the outputs; resumed as NewRequestData.
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        past_min = request.num_output_tokens >= params.min_tokens
        if past_min and not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if past_min and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark a request (already out of the queues) finished and free its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            # Only a running request is known to the runner (a preempted one was dropped there).
            self._finished_req_ids.add(request.req_id)
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.req_id]
        del self._arrival_order[request.req_id]

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.req_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            sampling_seed=request.sampling_seed,
            block_ids=self.kv_cache_manager.get_block_ids(request.req_id),
            num_computed_tokens=request.num_computed_tokens,
        )

    @staticmethod
    def _output(
        request: Request, new_token_ids: list[int], new_logprobs: list[SampleLogprobs] | None
    ) -> EngineCoreOutput:
        queue_time_s = None
        if not request.queue_time_reported:
            queue_time_s, request.queue_time_reported = request.queue_time_s, True
        return EngineCoreOutput(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            queue_time_s=queue_time_s,
        )
