"""Tiny random HF models saved as checkpoints, and a minimal paged runner to drive our models in tests."""

from __future__ import annotations

import os
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vllm_lite.config import ModelConfig, ModelSource, load_hf_config
from vllm_lite.models.attention import AttentionMetadata, PrefillSegment, allocate_kv_cache

TINY_DIMS = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # 64 with block size 16: the native decode kernel's shapes
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_DIMS, **overrides})


def tiny_qwen2_config(**overrides: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY_DIMS, **overrides})


def random_hf_model(hf_config: Any, seed: int = 0) -> nn.Module:
    """A HF causal LM with every parameter random, biases and norm weights included.

    HF initialises biases to zero and norm weights to one, which would hide a bias or norm mix-up.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.08)
    return model


def save_model_config(hf_model: nn.Module, directory: str, max_model_len: int = 128) -> ModelConfig:
    """Save `hf_model` as a safetensors checkpoint and describe it as our ModelConfig."""
    hf_model.save_pretrained(directory)
    source = ModelSource(os.fspath(directory))
    return ModelConfig(
        model=source.directory,
        source=source,
        hf_config=load_hf_config(source),
        dtype="float32",
        max_model_len=max_model_len,
    )


class PagedRunner:
    """Feeds requests' tokens to one of our models as flat steps over a paged KV cache.

    Request i owns blocks [i * blocks_per_request, (i + 1) * blocks_per_request). In a step, a request
    with one new token after some context is a decode; anything else is a prefill segment.
    """

    def __init__(
        self, model: nn.Module, num_requests: int = 4, block_size: int = 16, blocks_per_request: int = 8
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.blocks_per_request = blocks_per_request
        layers = model.attention_layers()
        param = next(model.parameters())
        caches = allocate_kv_cache(
            len(layers),
            num_requests * blocks_per_request,
            block_size,
            layers[0].num_kv_heads,
            layers[0].head_dim,
            param.dtype,
            param.device,
        )
        for layer, cache in zip(layers, caches, strict=True):
            layer.kv_cache = cache
        self.num_computed = [0] * num_requests

    def block_table(self, request: int) -> torch.Tensor:
        first = request * self.blocks_per_request
        return torch.arange(first, first + self.blocks_per_request, dtype=torch.int64)

    def build_step(
        self, work: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[int, int]]]:
        """(input_ids, positions, metadata, (start, len) of each work item's rows), without running."""
        is_decode = [len(tokens) == 1 and self.num_computed[req] > 0 for req, tokens in work]
        order = [i for i, d in enumerate(is_decode) if d] + [i for i, d in enumerate(is_decode) if not d]
        ids, positions, slots, spans = [], [], [], [None] * len(work)
        prefills, decode_tables, decode_lens = [], [], []
        for i in order:
            req, tokens = work[i]
            start, table = self.num_computed[req], self.block_table(req)
            pos = torch.arange(start, start + len(tokens))
            spans[i] = (len(ids), len(tokens))
            if is_decode[i]:
                decode_tables.append(table.to(torch.int32))
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillSegment(len(ids), len(tokens), start + len(tokens), table))
            ids += list(tokens)
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            self.num_computed[req] += len(tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            num_decodes=len(decode_lens),
            decode_block_tables=torch.stack(decode_tables) if decode_tables else None,
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32) if decode_lens else None,
            prefills=tuple(prefills),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.cat(positions), meta, spans

    @torch.inference_mode()
    def step(self, work: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        """Run one step; the logits [len(tokens), vocab] of every (request, new tokens) work item."""
        input_ids, positions, meta, spans = self.build_step(work)
        logits = self.model.compute_logits(self.model(input_ids, positions, meta))
        return [logits[start : start + length] for start, length in spans]


def tp_worker(
    rank: int, world_size: int, port: int, model_dir: str, config: dict, prompt: list[int], out_path: str
) -> None:
    """One rank of a TP group over gloo: load the checkpoint in `model_dir` sharded, run a prefill
    and one decode, and (rank 0) save both steps' logits to `out_path`."""
    import torch.distributed as dist

    from vllm_lite.models.layers import TPContext
    from vllm_lite.models.loader import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        source = ModelSource(model_dir)
        hf_config = types.SimpleNamespace(**config)
        model_config = ModelConfig(model_dir, source, hf_config, "float32", max_model_len=128)
        tp = TPContext(rank=rank, size=world_size, group=dist.group.WORLD)
        model = load_model(model_config, torch.device("cpu"), torch.float32, tp)
        runner = PagedRunner(model)
        prefill = runner.step([(0, prompt[:-1])])[0]
        decode = runner.step([(0, prompt[-1:])])[0]
        if rank == 0:
            torch.save({"prefill": prefill, "decode": decode}, out_path)
        # Both ranks are done with every collective; exit without tearing gloo down, whose C++
        # destructors can abort (SIGABRT) when the peer hosting the store exits at the same time.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)
