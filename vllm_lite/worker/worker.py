"""One worker: a device, this rank's model shard and its KV cache (TP size 1 for now)."""

from __future__ import annotations

import logging
import os

import torch

from vllm_lite.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from vllm_lite.models.attention import kv_cache_bytes_per_block
from vllm_lite.protocol.step import ModelRunnerOutput, SchedulerOutput
from vllm_lite.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Without --kv-cache-memory / --num-kv-blocks: this many GiB on CPU (vLLM's CPU default is 4) but
# never more than this share of the memory still available; on CUDA, this share of free memory.
DEFAULT_CPU_KV_GIB = 4.0
MAX_CPU_MEMORY_SHARE = 0.4
CUDA_MEMORY_SHARE = 0.8


def available_cpu_memory() -> int:
    """Bytes of memory still available on this machine (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class Worker:
    """Owns the device and the model runner; the executor drives it step by step."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device_config: DeviceConfig,
        eos_token_ids: list[int],
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.device = torch.device(device_config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(device_config.num_threads or os.cpu_count() or 1)
        torch.manual_seed(model_config.seed)
        self.runner = ModelRunner(model_config, cache_config, self.device, eos_token_ids)

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks this worker can hold, from the cache config or free memory."""
        cc, mc = self.cache_config, self.model_config
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = kv_cache_bytes_per_block(
            mc.num_layers,
            cc.block_size,
            self.runner.model.attention_layers()[0].num_kv_heads,
            mc.head_dim,
            self.runner.dtype,
        )
        if cc.kv_cache_memory_gib is not None:
            budget = int(cc.kv_cache_memory_gib * (1 << 30))
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * CUDA_MEMORY_SHARE)
        else:
            budget = min(
                int(DEFAULT_CPU_KV_GIB * (1 << 30)), int(available_cpu_memory() * MAX_CPU_MEMORY_SHARE)
            )
        num_blocks = budget // per_block
        if cc.kv_cache_memory_gib is None:
            # An automatic budget never exceeds what max_num_seqs full-length sequences can use.
            per_seq = -(-self.max_model_len // cc.block_size)
            num_blocks = min(num_blocks, self.max_num_seqs * per_seq)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget / (1 << 30):.3f} GiB) is smaller than one block "
                f"({per_block / (1 << 20):.2f} MiB); raise --kv-cache-memory"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            cc.block_size,
            num_blocks * per_block / (1 << 30),
        )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
