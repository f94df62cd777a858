"""Paged attention: the KV-cache layout, the per-step attention metadata and the `Attention` layer.

Every layer's KV cache is a pair of tensors of fixed-size blocks:
  key cache   [num_blocks, num_kv_heads, head_dim, block_size]  (keys transposed inside a block, so
              the decode kernel scores a whole block of tokens with one vector FMA per dimension)
  value cache [num_blocks, num_kv_heads, block_size, head_dim]
A request owns a list of block ids (its block table); token t of a request lives in block
`table[t // block_size]` at offset `t % block_size`.

The runner lays out one step's tokens as: all decode tokens first (one per request), then the
prefill segments (chunks of prompt, possibly after cached context). Decodes run as one batched
kernel call; each prefill segment uses scaled-dot-product attention over its context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.models import cpu_kernels, hugepages

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PrefillSegment:
    """One request's prefill chunk: `query_len` new tokens after `context_len - query_len` cached."""

    query_start: int  # index of its first token in the step's flat token layout
    query_len: int
    context_len: int  # tokens in the KV cache once this step has written its new ones
    block_table: torch.Tensor  # [num_blocks_of_request] int64, on the model's device


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what each token attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_decodes: int  # the first num_decodes tokens are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, including the new token
    prefills: tuple[PrefillSegment, ...]


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """Allocate every layer's (key, value) block tensors."""
    key_shape = (num_blocks, num_kv_heads, head_dim, block_size)
    value_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    return [(_zeros(key_shape, dtype, device), _zeros(value_shape, dtype, device)) for _ in range(num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Zeroed, not empty: the torch decode path multiplies masked-out slots by 0, and 0 * NaN garbage
    # would poison it. On CPU the memory is first marked for transparent huge pages: decode reads
    # blocks scattered over the whole cache, and 4 KiB pages made it TLB-bound.
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if tensor.device.type == "cpu":
        hugepages.advise(tensor)
    return tensor.zero_()


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Memory one block takes across all layers, keys and values."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ([num_tokens, num_kv_heads, head_dim]) at their slots."""
    key_cache, value_cache = kv_cache
    block_size = key_cache.shape[-1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    # Advanced indices on dims 0 and 3 (separated by slices) put the token dim first: [T, KVH, D].
    key_cache[blocks, :, :, offsets] = k
    value_cache[blocks, :, offsets, :] = v


def gather_kv(kv_cache: KVCache, block_table: torch.Tensor, context_len: int) -> KVCache:
    """One request's first `context_len` keys and values as [num_kv_heads, context_len, head_dim]."""
    key_cache, value_cache = kv_cache
    block_size = key_cache.shape[-1]
    num_blocks = (context_len + block_size - 1) // block_size
    table = block_table[:num_blocks]
    kvh, dim = key_cache.shape[1], key_cache.shape[2]
    keys = key_cache[table].permute(1, 0, 3, 2).reshape(kvh, num_blocks * block_size, dim)
    values = value_cache[table].permute(1, 0, 2, 3).reshape(kvh, num_blocks * block_size, dim)
    return keys[:, :context_len], values[:, :context_len]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kwargs) -> torch.Tensor:
    """SDPA on [heads, len, dim] tensors with grouped-query heads.

    A batch dim of 1 is added because the fused (flash) CPU kernel takes 4-D inputs only; 3-D ones
    fall back to the slow math path.
    """
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], scale=scale, enable_gqa=q.shape[0] != k.shape[0], **kwargs
    )
    return out[0]


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, seg: PrefillSegment, scale: float
) -> torch.Tensor:
    """Causal attention of one segment's queries [q_len, H, D] over its whole context."""
    q_t = q.transpose(0, 1)
    if seg.context_len == seg.query_len:
        # Nothing cached before this chunk: attend to the fresh keys directly.
        out = _sdpa(q_t, k.transpose(0, 1), v.transpose(0, 1), scale, is_causal=True)
    else:
        keys, values = gather_kv(kv_cache, seg.block_table, seg.context_len)
        past = seg.context_len - seg.query_len
        # Query i sits at absolute position past + i and sees keys 0..past + i.
        rows = torch.arange(seg.query_len, device=q.device)[:, None] + past
        mask = torch.arange(seg.context_len, device=q.device)[None, :] <= rows
        out = _sdpa(q_t, keys, values, scale, attn_mask=mask)
    return out.transpose(0, 1)


def decode_attention_reference(
    q: torch.Tensor, kv_cache: KVCache, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Batched single-token attention through block tables, in plain torch (any device)."""
    key_cache, value_cache = kv_cache
    num_reqs, max_blocks = block_tables.shape
    block_size, kvh, dim = key_cache.shape[-1], key_cache.shape[1], key_cache.shape[2]
    length = max_blocks * block_size
    tables = block_tables.long()
    keys = key_cache[tables].permute(0, 2, 1, 4, 3).reshape(num_reqs, kvh, length, dim)
    values = value_cache[tables].permute(0, 2, 1, 3, 4).reshape(num_reqs, kvh, length, dim)
    visible = torch.arange(length, device=q.device)[None, :] < context_lens[:, None].long()
    groups = q.shape[1] // kvh
    out = F.scaled_dot_product_attention(
        q.view(num_reqs, kvh, groups, dim), keys, values, attn_mask=visible[:, None, None, :], scale=scale
    )
    return out.reshape(num_reqs, kvh * groups, dim)


def decode_attention(
    q: torch.Tensor, kv_cache: KVCache, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Batched single-token attention: the native CPU kernel where it applies, else plain torch."""
    if cpu_kernels.supports(q, kv_cache[0]):
        return cpu_kernels.paged_decode(q, kv_cache[0], kv_cache[1], block_tables, context_lens, scale)
    return decode_attention_reference(q, kv_cache, block_tables, context_lens, scale)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    The model runner binds `kv_cache` once after allocating it; the layer has no weights.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: KVCache | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] -> [T, H*D]; writes k/v into the cache first."""
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound; the model runner binds it")
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(k, v, self.kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_attention(
                q[:nd], self.kv_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
            )
        for seg in meta.prefills:
            span = slice(seg.query_start, seg.query_start + seg.query_len)
            out[span] = prefill_attention(q[span], k[span], v[span], self.kv_cache, seg, self.scale)
        return out.view(num_tokens, self.num_heads * self.head_dim)
