"""Per-request block tables over a `BlockPool`, with automatic prefix caching.

Prefix caching works on full blocks only: once every token of a block has its KV computed, the
block is registered under a hash of its tokens chained with its parent's hash, so a later request
whose prompt starts with the same tokens reuses the block instead of recomputing it. Blocks are
ref-counted; a freed cached block stays hittable until the pool hands it out for new content.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_lite.engine_core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from vllm_lite.engine_core.request import Request


class KVCacheManager:
    """Allocates KV blocks to requests and shares full blocks between equal prefixes.

    Call order for a request: `get_computed_blocks` then `allocate_slots(..., computed_block_ids)`
    when it is first scheduled (or resumed after a preemption), `allocate_slots` again each step it
    runs, `cache_full_blocks` after its `num_computed_tokens` advanced, and `free` when it ends or
    is preempted.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request that are already registered in the prefix cache (or were
        # hit there), so each step only hashes the blocks that became full since.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens served from cached blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached-but-free blocks count as free)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table (empty if it holds no blocks)."""
        return [block.block_id for block in self._req_to_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request's full blocks: (block ids, number of tokens).

        At least one token is always left to compute, because the step that computes a request's
        last known token is the one that yields logits to sample from: when the whole sequence is
        cached, the last hit block is dropped. Pure lookup: nothing is reserved until
        `allocate_slots` is called with the result (with no other allocation in between).
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            block_ids.append(block.block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; return the ids of the blocks added.

        `computed_block_ids` (from `get_computed_blocks`) is only given for a request that holds
        no blocks yet; its tokens count as computed on top of `request.num_computed_tokens`. The
        returned list holds only freshly allocated blocks, not the prefix hits. Returns None, and
        changes nothing, when the free (including evictable) blocks are not enough.
        """
        table = self._req_to_blocks.get(request.req_id, [])
        if computed_block_ids and table:
            raise ValueError(f"request {request.req_id!r} already holds blocks; no prefix hit allowed")
        computed = [self.pool.blocks[block_id] for block_id in computed_block_ids]
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(num_required - len(table) - len(computed), 0)
        # Reviving a free cached block takes it out of the free queue too.
        num_revived = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new_blocks > self.num_free_blocks - num_revived:
            return None

        if self.enable_prefix_caching and not table:
            # Counted on the first successful allocation, so a request that waits for memory
            # over several steps is counted once.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed) * self.block_size
            self._num_cached_blocks[request.req_id] = len(computed)
        self.pool.touch(computed)
        new_blocks = self.pool.allocate(num_new_blocks)
        self._req_to_blocks[request.req_id] = table + computed + new_blocks
        return [block.block_id for block in new_blocks]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks whose tokens are all computed now (prompt or output)."""
        if not self.enable_prefix_caching:
            return
        table = self._req_to_blocks.get(request.req_id)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_cached_blocks.get(request.req_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for block, block_hash in zip(
            table[start:num_full], request.block_hashes[start:num_full], strict=True
        ):
            self.pool.cache_block(block, block_hash)
        self._num_cached_blocks[request.req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks; a no-op for a request that holds none."""
        blocks = self._req_to_blocks.pop(request.req_id, [])
        self._num_cached_blocks.pop(request.req_id, None)
        # Tail first: a block is only useful with its whole prefix, so the tail should be
        # evicted before its parents.
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (for example after weights changed)."""
        self.pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to cover every full block of its known tokens."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        parent = hashes[-1] if hashes else None
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            parent = hash_block_tokens(parent, tokens[start : start + size])
            hashes.append(parent)
