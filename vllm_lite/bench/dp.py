"""`vllm-lite bench throughput --data-parallel-size N`: N engine cores against one, same run.

Both deployments serve the same workload through `AsyncEngineClient` (random token prompts,
fixed output length, `ignore_eos`), each after a warm-up on the same shapes with the prefix
cache emptied; the result is the ratio of output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from vllm_lite.bench.client import run_through_client, workload_params
from vllm_lite.config import EngineArgs


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
    client = AsyncEngineClient.from_engine_args(engine_args)
    try:
        result = asyncio.run(run_through_client(client, prompts, workload_params(args)))
    finally:
        client.shutdown()
    return {"dp_size": dp_size, **result}


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
