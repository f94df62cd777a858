"""EngineCore: one DP rank's scheduler and executor; `step()` is schedule -> execute -> update."""

from __future__ import annotations

import logging
import random
import time

from vllm_lite.config import EngineConfig
from vllm_lite.engine_core.executor import Executor, UniProcExecutor
from vllm_lite.engine_core.request import Request
from vllm_lite.engine_core.scheduler import Scheduler
from vllm_lite.inputs import validate_prompt_token_ids
from vllm_lite.protocol.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.protocol.step import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

DUMMY_REQ_ID = "__vllm_lite_dummy__"
_DUMMY_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class EngineCore:
    """Continuous batching over a paged KV cache, driven one `step()` at a time."""

    def __init__(
        self, config: EngineConfig, executor: Executor | None = None, reserve_dummy_block: bool = False
    ) -> None:
        """`reserve_dummy_block`: keep one KV block out of the scheduler's hands for
        `dummy_step` (DP lockstep), so that a dummy forward never touches a real request's cache."""
        self.config = config
        mc = config.model_config
        self.eos_token_ids = mc.eos_token_ids
        self.executor = executor or UniProcExecutor(config, self.eos_token_ids)
        self.num_kv_blocks = self.executor.determine_num_kv_blocks()
        if reserve_dummy_block and self.num_kv_blocks < 2:
            raise ValueError("DP lockstep needs at least 2 KV blocks (one is kept for dummy steps)")
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        self._dummy_block = self.num_kv_blocks - 1 if reserve_dummy_block else None
        usable = self.num_kv_blocks - (1 if reserve_dummy_block else 0)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, usable)
        capacity = self.num_kv_blocks * config.cache_config.block_size
        if capacity < config.scheduler_config.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: longer sequences end with "
                "finish_reason 'length'",
                capacity,
                config.scheduler_config.max_model_len,
            )
        # Unseeded requests draw their seed here: reproducible for one --seed, distinct per request.
        self._seed_rng = random.Random(mc.seed)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and queue a request; raises ValueError for anything it cannot serve."""
        self.validate_prompt(request.prompt_token_ids)
        params = request.sampling_params
        if params.n != 1:
            raise ValueError("EngineCore takes n=1 requests; the client fans out n>1 into n requests")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        self.scheduler.add_request(
            Request(
                req_id=request.req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=params,
                sampling_seed=seed,
                eos_token_ids=tuple(self.eos_token_ids),
                arrival_time=request.arrival_time or time.monotonic(),
                max_model_len=self.config.scheduler_config.max_model_len,
            )
        )

    def validate_prompt(self, token_ids: list[int]) -> None:
        """Reject empty, out-of-vocabulary or too long prompts with a clear message."""
        validate_prompt_token_ids(
            token_ids, self.config.model_config.vocab_size, self.config.scheduler_config.max_model_len
        )

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort requests and free their KV blocks at once."""
        return self.scheduler.abort_requests(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and return the new tokens of every request that got one."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def dummy_step(self) -> None:
        """One forward pass of a 1-token dummy request in the reserved block: what a DP rank with
        no work runs so that every rank steps together (lockstep waves)."""
        if self._dummy_block is None:
            raise RuntimeError("dummy_step needs an EngineCore made with reserve_dummy_block=True")
        dummy = NewRequestData(
            req_id=DUMMY_REQ_ID,
            prompt_token_ids=[0],
            output_token_ids=[],
            sampling_params=_DUMMY_PARAMS,
            sampling_seed=0,
            block_ids=[self._dummy_block],
            num_computed_tokens=0,
        )
        self.executor.execute_model(
            SchedulerOutput(
                new_reqs=[dummy],
                cached_reqs=[],
                num_scheduled_tokens={DUMMY_REQ_ID: 1},
                total_num_scheduled_tokens=1,
                finished_req_ids=[],
                preempted_req_ids=[],
            )
        )

    def get_stats(self) -> EngineStats:
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
