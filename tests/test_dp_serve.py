"""Data parallelism through the HTTP server: DP=4 on one node, and a head + headless pair over TCP."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
from openai_server import OpenAIServer, free_port, kill_tree

pytestmark = pytest.mark.e2e

SMALL = ["--num-kv-blocks", "256", "--max-model-len", "512"]


def per_engine(metrics: str, name: str) -> dict[int, float]:
    """{engine: value} of one per-engine metric in a Prometheus exposition."""
    pattern = re.compile(rf'^vllm_lite:{name}{{engine="(\d+)",[^}}]*}} ([0-9.e+-]+)$', re.M)
    return {int(e): float(v) for e, v in pattern.findall(metrics)}


async def complete_all(server: OpenAIServer, n: int, max_tokens: int, stream: bool) -> list[int]:
    """Send n concurrent completions; the completion token count of each."""
    client = server.async_client(timeout=300.0)

    async def one(i: int) -> int:
        kwargs = {"model": server.model, "prompt": f"Request {i}:", "max_tokens": max_tokens}
        if stream:
            tokens = 0
            finish = None
            response = await client.completions.create(
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **kwargs
            )
            async for chunk in response:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
            assert finish == "length"
            return tokens
        response = await client.completions.create(extra_body={"ignore_eos": True}, **kwargs)
        return response.usage.completion_tokens

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


@pytest.mark.parametrize("dp_size", [2, 4])
def test_200_concurrent_streams_are_served_by_every_rank(dp_size):
    with OpenAIServer(["--data-parallel-size", str(dp_size), *SMALL]) as server:
        assert len(server.engine_processes()) == dp_size
        counts = asyncio.run(asyncio.wait_for(complete_all(server, 200, 5, stream=True), 600))
        assert counts == [5] * 200
        metrics = server.http().get("/metrics").text
        queries = per_engine(metrics, "prefix_cache_queries_total")
        assert sorted(queries) == list(range(dp_size))
        fair = sum(queries.values()) / dp_size
        assert min(queries.values()) >= fair / 4, queries
        assert set(per_engine(metrics, "num_requests_running").values()) == {0.0}
        assert set(per_engine(metrics, "num_requests_waiting").values()) == {0.0}


def test_head_and_headless_nodes_share_the_load_over_tcp():
    rpc_port = free_port()
    multi = [
        "--data-parallel-size",
        "4",
        "--data-parallel-size-local",
        "2",
        "--data-parallel-rpc-port",
        str(rpc_port),
    ]
    head = OpenAIServer([*multi, *SMALL])
    head.spawn()
    headless = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_lite.cli",
            "serve",
            "--headless",
            *multi,
            "--data-parallel-start-rank",
            "2",
            *SMALL,
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    headless_tree: list[psutil.Process] = []
    try:
        head.wait_ready()
        headless_tree = [psutil.Process(headless.pid), *psutil.Process(headless.pid).children(recursive=True)]
        assert len(head.engine_processes()) == 2 and len(headless_tree) == 3
        counts = asyncio.run(asyncio.wait_for(complete_all(head, 40, 3, stream=False), 600))
        assert counts == [3] * 40
        queries = per_engine(head.http().get("/metrics").text, "prefix_cache_queries_total")
        assert sorted(queries) == [0, 1, 2, 3] and min(queries.values()) > 0, queries
        # The head goes away: the headless node follows (its engines see the frontend gone).
        assert head.terminate() == 0
        assert headless.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(headless_tree, timeout=10)
        assert not alive
    finally:
        head.close()
        if headless.poll() is None:
            headless.send_signal(signal.SIGKILL)
        kill_tree(headless_tree)
