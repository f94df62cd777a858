"""Data parallelism with the mp launcher: several engine cores, the balancer, the DP group."""

from __future__ import annotations

import asyncio
import threading

import psutil
import pytest

from vllm_lite import AsyncEngineClient, EngineArgs, SamplingParams
from vllm_lite.dp.balancer import LoadBalancer
from vllm_lite.dp.env import DPEnv
from vllm_lite.dp.group import DPGroup, create_store
from vllm_lite.errors import EngineStartupError
from vllm_lite.launchers.mp import split_cpus
from vllm_lite.protocol.messages import EngineStats

ENGINE_KWARGS = {"model": "smollm2-135m", "num_kv_blocks": 512, "max_model_len": 512}


def stats(waiting: int, running: int, usage: float = 0.0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=usage)


def test_balancer_prefers_the_least_loaded_rank_and_counts_what_it_sent():
    balancer = LoadBalancer([0, 1, 2])
    balancer.update_stats(0, stats(waiting=2, running=5))
    balancer.update_stats(1, stats(waiting=0, running=9))
    balancer.update_stats(2, stats(waiting=0, running=9, usage=0.5))
    # 4 x waiting + running: 13, 9, 9 -> rank 1 (less KV in use than rank 2).
    assert balancer.choose([0, 1, 2]) == 1
    # Rank 1 now has one request in flight since its stats: 13, 13, 9 -> rank 2.
    assert balancer.choose([0, 1, 2]) == 2
    # Dead ranks are not chosen.
    assert balancer.choose([0]) == 0
    # Fresh stats replace the local count.
    balancer.update_stats(1, stats(0, 0))
    assert balancer.choose([0, 1, 2]) == 1


def test_balancer_rotates_among_equals():
    balancer = LoadBalancer([0, 1])
    chosen = [balancer.choose([0, 1]) for _ in range(8)]
    assert chosen.count(0) == chosen.count(1) == 4


def test_cpus_are_split_between_local_ranks():
    shares = split_cpus(1)
    assert shares[0] is not None and len(shares[0]) >= 1
    many = split_cpus(10_000)
    assert many == [None] * 10_000  # fewer CPUs than ranks: nobody pinned


def test_the_dp_group_is_real():
    """Stateless groups of 3 ranks: sizes, ranks, an all-reduce, an agreement check."""
    size = 3
    master = create_store(DPEnv(size, 0, 0, "127.0.0.1", 0), 0, timeout_s=30)
    port = master.port
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            dp = DPEnv(size, r, r, "127.0.0.1", port)
            store = master if r == 0 else create_store(dp, port, timeout_s=30)
            group = DPGroup.create(dp, store, timeout_s=30)
            total = group.all_reduce([r + 1, 10])
            group.check_agreement("config", "same")
            try:
                group.check_agreement("config", f"rank {r} differs" if r == 2 else "same")
                disagreement = None
            except RuntimeError as exc:
                disagreement = str(exc)
            results[r] = (group.rank, group.size, total, disagreement)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1, 2], results
    for r in range(size):
        group_rank, group_size, total, disagreement = results[r]
        assert (group_rank, group_size) == (r, size)
        assert total == [6.0, 30.0]
        assert disagreement is not None and "differs from ranks" in disagreement
    assert "[2]" in results[0][3] and "[0, 1]" in results[2][3]


@pytest.mark.e2e
@pytest.mark.parametrize("dp_size", [2, 4])
def test_200_concurrent_requests_are_served_by_every_rank(dp_size):
    client = AsyncEngineClient.from_engine_args(EngineArgs(data_parallel_size=dp_size, **ENGINE_KWARGS))
    ranks = list(range(dp_size))
    try:
        assert sorted(client.num_kv_blocks) == ranks
        engines = client._launcher.processes
        # Each rank has its own core (2 here) and one thread per core.
        affinities = [psutil.Process(p.pid).cpu_affinity() for p in engines.values()]
        if len(split_cpus(1)[0]) >= dp_size:
            cores = [set(a) for a in affinities]
            assert all(len(c) == len(cores[0]) for c in cores)
            assert sum(len(c) for c in cores) == len(set().union(*cores))  # disjoint

        async def main():
            params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)

            async def one(i: int) -> int:
                final = None
                async for out in client.generate(f"Request {i}: say something.", params):
                    final = out
                return len(final.outputs[0].token_ids)

            counts = await asyncio.gather(*(one(i) for i in range(200)))
            assert counts == [6] * 200
            per_rank = [await client.get_engine_stats(r) for r in ranks]
            return per_rank

        per_rank = asyncio.run(asyncio.wait_for(main(), 600))
        queries = [s.prefix_cache_queries for s in per_rank]
        # Every rank served at least a quarter of its fair share (prompt tokens looked up).
        assert min(queries) >= 0.25 * sum(queries) / dp_size, queries
        assert all(s.num_running == 0 and s.num_waiting == 0 for s in per_rank)
        assert not client.output_processor.requests

        async def pinned():
            before = (await client.get_engine_stats(1)).prefix_cache_queries
            async for _ in client.generate(
                "Pinned to rank 1.", SamplingParams(max_tokens=2), data_parallel_rank=1
            ):
                pass
            after = (await client.get_engine_stats(1)).prefix_cache_queries
            assert after > before
            with pytest.raises(ValueError, match="data_parallel_rank"):
                async for _ in client.generate("x", SamplingParams(max_tokens=1), data_parallel_rank=7):
                    pass

        asyncio.run(asyncio.wait_for(pinned(), 120))
    finally:
        client.shutdown()
    assert all(p.poll() is not None for p in client._launcher.processes.values())


@pytest.mark.e2e
def test_a_rank_that_fails_to_start_is_named_and_nothing_is_left():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(EngineStartupError, match=r"engine core [01] .*(failed to start|died)"):
        AsyncEngineClient.from_engine_args(
            EngineArgs(model="smollm2-135m", data_parallel_size=2, kv_cache_memory=1e-6)
        )
    leftover = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftover


@pytest.mark.e2e
def test_lockstep_keeps_every_rank_stepping_together():
    """Work only on rank 0: rank 1 runs a dummy step for each of rank 0's steps."""
    client = AsyncEngineClient.from_engine_args(
        EngineArgs(data_parallel_size=2, data_parallel_lockstep=True, **ENGINE_KWARGS)
    )
    try:

        async def main():
            params = SamplingParams(max_tokens=8, ignore_eos=True)

            async def one(i: int) -> int:
                final = None
                async for out in client.generate(f"Only rank 0, {i}.", params, data_parallel_rank=0):
                    final = out
                return len(final.outputs[0].token_ids)

            assert await asyncio.gather(*(one(i) for i in range(6))) == [8] * 6
            return [await client.get_engine_stats(r) for r in (0, 1)]

        busy, idle = asyncio.run(asyncio.wait_for(main(), 300))
        assert busy.prefix_cache_queries > 0 and idle.prefix_cache_queries == 0  # rank 1 served nothing
        assert busy.num_steps >= 8
        assert idle.num_steps == busy.num_steps
        assert client.num_kv_blocks[0] == ENGINE_KWARGS["num_kv_blocks"]
    finally:
        client.shutdown()
