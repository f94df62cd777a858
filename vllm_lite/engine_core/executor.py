"""Executors run a step on the engine's TP workers; one small interface, several transports.

Only the in-process executor exists so far (TP size 1); the multi-process shared-memory and Ray
executors implement the same interface.
"""

from __future__ import annotations

import abc

from vllm_lite.config import EngineConfig
from vllm_lite.protocol.step import ModelRunnerOutput, SchedulerOutput
from vllm_lite.worker.worker import Worker


class Executor(abc.ABC):
    """Drives the TP workers of one engine core."""

    @abc.abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the same number of blocks on every worker."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all workers; return the driver worker's sampled tokens. Raises on failure."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release workers; safe to call twice."""


class UniProcExecutor(Executor):
    """The single worker lives in the engine-core process itself."""

    def __init__(self, config: EngineConfig, eos_token_ids: list[int]) -> None:
        self.worker = Worker(
            config.model_config,
            config.cache_config,
            config.scheduler_config,
            config.device_config,
            eos_token_ids,
        )

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
