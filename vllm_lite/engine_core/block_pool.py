"""The pool of fixed-size KV blocks: ref counts, the free queue and the prefix-cache hash table.

A block is either in use (ref_cnt > 0, held by one or more requests' block tables) or free
(ref_cnt == 0, in the free queue). A free block that still carries a content hash is *evictable*:
it can be hit by a later request with the same prefix until it is handed out for new content.
The free queue is ordered for eviction: blocks without a hash sit at the front (nothing is lost
by reusing them), hashed blocks are appended in the order they were freed, so the least recently
freed cached block is evicted first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Content hash of one full block, chained with its parent block's hash.

    Chaining makes a block's hash identify the whole prefix up to and including it. blake2b over
    packed little-endian int64s is the same in every process (unlike the salted built-in `hash`
    of str/bytes), so hashes could be compared across ranks.
    """
    hasher = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        hasher.update(parent_hash)
    hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return hasher.digest()


class KVCacheBlock:
    """Bookkeeping of one physical KV block (the tensors live in the model runner)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockPool:
    """All KV blocks of one engine core, with allocation, ref counting and the hash table."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free block ids in eviction order (front = next to hand out); an OrderedDict so that a
        # cached free block that is hit again can leave the middle of the queue in O(1).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, evictable cached blocks included."""
        return len(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue, evicting their hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.blocks[self._free.popitem(last=False)[0]]
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on blocks hit in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block, in the given order (the order they become evictable)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its content hash so other requests can share it.

        If another block already holds the same content (two requests computed the same prefix
        at the same time), the first one stays registered and this one is left unshared.
        """
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash; blocks in use keep their contents but are no longer shareable."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
