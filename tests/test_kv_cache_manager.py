"""KVCacheManager and BlockPool: block accounting, prefix-cache hits, ref counts, LRU eviction."""

from __future__ import annotations

import subprocess
import sys

from engine_factories import make_request

from vllm_lite.engine_core.block_pool import hash_block_tokens
from vllm_lite.engine_core.kv_cache_manager import KVCacheManager
from vllm_lite.engine_core.request import Request

BS = 4


def compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Admit `request` as the scheduler does and mark `num_tokens` (default: all) as computed."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    block_ids, num_computed = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, num_tokens - num_computed, block_ids)
    assert new is not None
    request.num_computed_tokens = num_tokens
    kv.cache_full_blocks(request)
    return kv.get_block_ids(request.req_id)


def ref_cnt(kv: KVCacheManager, block_id: int) -> int:
    return kv.pool.blocks[block_id].ref_cnt


def test_allocate_rounds_up_and_free_restores_count() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    req = make_request("a", 5)
    assert kv.allocate_slots(req, 5) is not None
    assert len(kv.get_block_ids("a")) == 2 and kv.num_free_blocks == 8
    req.num_computed_tokens = 5
    # Three more tokens still fit in the second block; a fourth needs a new one.
    assert kv.allocate_slots(req, 3) == []
    assert len(kv.allocate_slots(req, 4)) == 1
    assert kv.usage == 0.3
    kv.free(req)
    assert kv.num_free_blocks == 10 and kv.usage == 0.0 and kv.get_block_ids("a") == []


def test_allocate_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    big = make_request("big", 13)  # 4 blocks
    assert kv.allocate_slots(big, 13) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids("big") == []
    assert kv.prefix_cache_queries == 0  # a failed admission is not counted as a lookup
    assert kv.allocate_slots(big, 12) is not None


def test_prefix_hit_is_shared_and_ref_counted() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prefix = list(range(1, 9))
    a = make_request("a", [*prefix, 50, 51])
    b = make_request("b", [*prefix, 60, 61, 62])
    blocks_a = compute(kv, a)
    assert kv.prefix_cache_queries == 10 and kv.prefix_cache_hits == 0

    assert kv.get_computed_blocks(b) == (blocks_a[:2], 8)
    blocks_b = compute(kv, b)
    assert blocks_b[:2] == blocks_a[:2] and blocks_b[2] != blocks_a[2]
    assert [ref_cnt(kv, i) for i in blocks_a] == [2, 2, 1]
    assert kv.prefix_cache_queries == 21 and kv.prefix_cache_hits == 8
    assert kv.num_free_blocks == 10 - 4

    kv.free(a)
    assert [ref_cnt(kv, i) for i in blocks_b] == [1, 1, 1]
    assert kv.num_free_blocks == 10 - 3
    kv.free(b)
    assert kv.num_free_blocks == 10


def test_full_prompt_hit_leaves_last_block_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 9))  # exactly two full blocks
    blocks_a = compute(kv, make_request("a", prompt))
    same = make_request("same", prompt)
    assert kv.get_computed_blocks(same) == (blocks_a[:1], 4)
    longer = make_request("longer", [*prompt, 9])
    assert kv.get_computed_blocks(longer) == (blocks_a, 8)


def test_partial_blocks_and_uncomputed_blocks_are_not_cached() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 12))
    compute(kv, make_request("a", prompt), num_tokens=6)  # only the first block is fully computed
    assert kv.get_computed_blocks(make_request("b", prompt))[1] == 4


def test_output_token_blocks_become_shareable() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3])
    compute(kv, a)
    for token in (4, 5, 6):  # decode: one new token per step
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        kv.cache_full_blocks(a)
    # Tokens 1..5 are computed (6 is sampled but its KV is not written yet).
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 4


def test_freed_cached_block_is_revived_and_counted_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 9))
    a = make_request("a", prompt)
    blocks_a = compute(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3

    b = make_request("b", [*prompt, 9, 10, 11, 12, 13])  # hits 2 blocks, needs 2 more: 4 > 3
    hit, num_hit = kv.get_computed_blocks(b)
    assert (hit, num_hit) == (blocks_a, 8)
    assert kv.allocate_slots(b, 5, hit) is None
    assert kv.num_free_blocks == 3 and all(ref_cnt(kv, i) == 0 for i in blocks_a)
    assert len(kv.allocate_slots(b, 4, hit)) == 1  # 2 revived + 1 new
    assert kv.num_free_blocks == 0 and [ref_cnt(kv, i) for i in blocks_a] == [1, 1]


def test_eviction_is_least_recently_freed_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    reqs = [
        make_request(name, [base, base + 1, base + 2, base + 3])
        for name, base in zip("abc", (10, 20, 30), strict=True)
    ]
    for req in reqs:
        compute(kv, req)
    for req in reqs:
        kv.free(req)

    # The never-cached block goes first, then a's block (freed earliest); b and c stay cached.
    assert len(kv.allocate_slots(make_request("new", 8), 8)) == 2
    probes = {r.req_id: make_request("p", [*r.prompt_token_ids, 99]) for r in reqs}
    assert [kv.get_computed_blocks(p)[1] for p in probes.values()] == [0, 4, 4]


def test_tail_block_is_evicted_before_its_parent() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 9))
    a = make_request("a", prompt)
    compute(kv, a)
    kv.free(a)
    assert len(kv.allocate_slots(make_request("new", 3), 3)) == 1
    assert kv.get_computed_blocks(make_request("p", [*prompt, 9]))[1] == 4


def test_reset_and_disabled_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 10))
    a = make_request("a", prompt)
    compute(kv, a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    kv.free(a)
    assert kv.num_free_blocks == 8

    off = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    compute(off, make_request("a", prompt))
    assert off.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert off.prefix_cache_queries == 0 and off.prefix_cache_hits == 0


def test_block_hash_is_chained_and_stable_across_processes() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == root
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != root
    code = (
        "from vllm_lite.engine_core.block_pool import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == hash_block_tokens(root, [5, 6, 7, 8]).hex()
