"""`vllm-lite bench throughput --data-parallel-size N`: N engine cores against one, same run.

Both deployments serve the same workload through `AsyncEngineClient` (random token prompts,
fixed output length, `ignore_eos`), each after a warm-up on the same shapes with the prefix
cache emptied; the result is the ratio of output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from vllm_lite.config import EngineArgs
from vllm_lite.protocol.sampling_params import RequestOutputKind, SamplingParams


async def _serve(client: Any, prompts: list[list[int]], params: SamplingParams) -> int:
    async def one(prompt: list[int], p: SamplingParams) -> int:
        n = 0
        async for out in client.generate(prompt, p):
            n += sum(len(c.token_ids) for c in out.outputs)
        return n

    return sum(await asyncio.gather(*(one(p, params) for p in prompts)))


def measure(args: argparse.Namespace, dp_size: int, prompts: list[list[int]]) -> dict[str, float]:
    """Output tokens/s of one deployment of `dp_size` engine cores on the workload."""
    from vllm_lite.frontend.client import AsyncEngineClient

    engine_args = EngineArgs(
        model=args.model,
        data_parallel_size=dp_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
        seed=args.seed,
    )
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output_len,
        ignore_eos=True,
        seed=args.seed,
        output_kind=RequestOutputKind.DELTA,
    )
    warmup = SamplingParams(max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    client = AsyncEngineClient.from_engine_args(engine_args)
    try:

        async def run() -> tuple[int, float]:
            await _serve(client, prompts, warmup)
            await client.reset_prefix_cache()
            t0 = time.perf_counter()
            generated = await _serve(client, prompts, params)
            return generated, time.perf_counter() - t0

        generated, elapsed = asyncio.run(run())
    finally:
        client.shutdown()
    return {
        "dp_size": dp_size,
        "output_tokens": generated,
        "elapsed_s": elapsed,
        "tokens_per_s": generated / elapsed,
    }


def run_dp_comparison(args: argparse.Namespace, prompts: list[list[int]]) -> int:
    single = measure(args, 1, prompts)
    multi = measure(args, args.data_parallel_size, prompts)
    ratio = multi["tokens_per_s"] / single["tokens_per_s"]
    print(
        f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out tokens "
        f"({args.dataset}, temperature {args.temperature}), through AsyncEngineClient"
    )
    print(f"{'deployment':<34}{'output tok/s':>14}{'time s':>10}")
    for r in (single, multi):
        print(f"{'DP=' + str(r['dp_size']):<34}{r['tokens_per_s']:>14.1f}{r['elapsed_s']:>10.1f}")
    print(f"DP={args.data_parallel_size} / DP=1: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dp1": single, f"dp{args.data_parallel_size}": multi, "ratio": ratio}, f, indent=2)
    return 0
