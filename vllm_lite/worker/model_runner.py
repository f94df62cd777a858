"""The model runner: keeps per-request state, builds each step's flat batch, runs the model, samples.

It receives the scheduler's differences (`SchedulerOutput`) and holds what it needs to rebuild the
batch every step: each request's tokens, blocks and computed count. Tokens it samples it appends
to its own copy, so the scheduler never has to send them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_lite.config import CacheConfig, ModelConfig
from vllm_lite.models.attention import AttentionMetadata, KVCache, PrefillSegment, allocate_kv_cache
from vllm_lite.models.loader import load_model
from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.protocol.step import ModelRunnerOutput, NewRequestData, SchedulerOutput
from vllm_lite.worker.sampler import Sampler, SamplingMetadata, SamplingRow

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CachedRequestState:
    """What the runner knows of one request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    sampling_seed: int
    block_ids: list[int]
    num_computed_tokens: int
    token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    @classmethod
    def from_new(cls, data: NewRequestData) -> CachedRequestState:
        return cls(
            req_id=data.req_id,
            prompt_token_ids=list(data.prompt_token_ids),
            output_token_ids=list(data.output_token_ids),
            sampling_params=data.sampling_params,
            sampling_seed=data.sampling_seed,
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
        )

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


@dataclass(frozen=True)
class _StepBatch:
    """One step's flat inputs and which rows are sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[CachedRequestState]


class ModelRunner:
    """Runs one model (this TP rank's shard) over the paged KV cache."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        eos_token_ids: list[int],
    ) -> None:
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = device
        self.dtype = _DTYPES[model_config.dtype]
        self.eos_token_ids = eos_token_ids
        self.model = load_model(model_config, device=device, dtype=self.dtype)
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[KVCache] = []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks per layer and bind them to the attention layers."""
        mc = self.model_config
        layers = self.model.attention_layers()
        self.kv_caches = allocate_kv_cache(
            len(layers),
            num_blocks,
            self.block_size,
            layers[0].num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        for layer, cache in zip(layers, self.kv_caches, strict=True):
            layer.kv_cache = cache

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the scheduler's differences, run one forward pass and sample."""
        self._update_states(sched)
        if not sched.total_num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        batch = self._prepare_inputs(sched)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        if not batch.sampled:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        logits = self.model.compute_logits(hidden[batch.logits_indices]).float()
        rows = [
            SamplingRow(s.sampling_params, s.sampling_seed, s.prompt_token_ids, s.output_token_ids)
            for s in batch.sampled
        ]
        meta = SamplingMetadata.build(rows, logits.shape[-1], self.eos_token_ids, logits.device)
        out = self.sampler(logits, meta)
        for state, token in zip(batch.sampled, out.token_ids, strict=True):
            state.append_output(token)
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in batch.sampled], sampled_token_ids=out.token_ids, logprobs=out.logprobs
        )

    def _update_states(self, sched: SchedulerOutput) -> None:
        # Preempted requests are dropped like finished ones; they come back as NewRequestData.
        for req_id in (*sched.finished_req_ids, *sched.preempted_req_ids):
            self.requests.pop(req_id, None)
        for data in sched.new_reqs:
            self.requests[data.req_id] = CachedRequestState.from_new(data)
        for data in sched.cached_reqs:
            state = self.requests[data.req_id]
            state.block_ids.extend(data.new_block_ids)
            state.num_computed_tokens = data.num_computed_tokens

    def _prepare_inputs(self, sched: SchedulerOutput) -> _StepBatch:
        """Lay the step out as [decodes..., prefill segments...] with slots and block tables."""
        bs = self.block_size
        decodes: list[CachedRequestState] = []
        prefills: list[CachedRequestState] = []
        for req_id, n in sched.num_scheduled_tokens.items():
            (decodes if n == 1 else prefills).append(self.requests[req_id])
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        logits_indices: list[int] = []
        sampled: list[CachedRequestState] = []

        def add(state: CachedRequestState, n: int) -> None:
            start = state.num_computed_tokens
            positions = np.arange(start, start + n, dtype=np.int64)
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            pos_parts.append(positions)
            slot_parts.append(blocks[positions // bs] * bs + positions % bs)
            ids.extend(state.token_ids[start : start + n])
            state.num_computed_tokens = start + n
            if state.num_computed_tokens == len(state.token_ids):
                logits_indices.append(len(ids) - 1)
                sampled.append(state)

        for state in decodes:
            add(state, 1)
        segments = []
        for state in prefills:
            n = sched.num_scheduled_tokens[state.req_id]
            segments.append((len(ids), n, state.num_computed_tokens + n, state.block_ids))
            add(state, n)

        dev = self.device
        decode_tables = decode_lens = None
        if decodes:
            width = max(len(s.block_ids) for s in decodes)
            table = np.zeros((len(decodes), width), dtype=np.int32)
            for i, s in enumerate(decodes):
                table[i, : len(s.block_ids)] = s.block_ids
            decode_tables = torch.from_numpy(table).to(dev)
            lens = np.fromiter((s.num_computed_tokens for s in decodes), dtype=np.int32, count=len(decodes))
            decode_lens = torch.from_numpy(lens).to(dev)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            num_decodes=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=tuple(
                PrefillSegment(start, n, ctx, torch.tensor(blocks[: (ctx + bs - 1) // bs], device=dev))
                for start, n, ctx, blocks in segments
            ),
        )
        return _StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sampled=sampled,
        )
