"""`vllm-lite bench client`: what the ZMQ path costs per token, measured side by side.

The same workload (random token prompts, fixed output length, `ignore_eos`) runs on an in-process
`EngineCore` and through `AsyncEngineClient` (an engine-core process, ZMQ sockets, msgspec, output
processing with detokenization on the client loop). The result is the ratio of output tokens/s,
measured A-B-A (in-process, client, in-process) so that drift on a shared machine shows up as a
gap between the two in-process runs instead of as a false ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import msgspec

from vllm_lite.bench.throughput import add_workload_args, make_prompts
from vllm_lite.config import EngineArgs, EngineConfig
from vllm_lite.protocol.sampling_params import RequestOutputKind, SamplingParams


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("client", help="AsyncEngineClient (ZMQ) tokens/s vs the in-process EngineCore")
    add_workload_args(p, input_len=64)
    p.set_defaults(func=run, dataset="random")


def workload_params(args: argparse.Namespace) -> SamplingParams:
    """The benchmarks' sampling: fixed output length (`ignore_eos`), streamed as deltas."""
    return SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output_len,
        ignore_eos=True,
        seed=args.seed,
        output_kind=RequestOutputKind.DELTA,
    )


def _warmup(params: SamplingParams) -> SamplingParams:
    return msgspec.structs.replace(params, max_tokens=4)


def _generate_in_process(core: Any, prompts: list[list[int]], params: SamplingParams, tag: str) -> int:
    from vllm_lite.protocol.messages import EngineCoreRequest

    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params, time.time()))
    generated = 0
    while core.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in core.step())
    return generated


def run_in_process(core: Any, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict[str, float]:
    """Tokens/s of `EngineCore.step()` driven in this process (no sockets, no detokenization),
    after a warm-up on the same shapes and with the prefix cache emptied."""
    _generate_in_process(core, prompts, _warmup(params), f"{tag}-warmup")
    core.scheduler.kv_cache_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    generated = _generate_in_process(core, prompts, params, tag)
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens": generated, "tokens_per_s": generated / elapsed}


async def run_through_client(
    client: Any, prompts: list[list[int]], params: SamplingParams
) -> dict[str, float]:
    """Output tokens/s of the workload through `client`, after a warm-up on the same shapes."""

    async def one(prompt: list[int], params: SamplingParams = params) -> int:
        n = 0
        async for out in client.generate(prompt, params):
            n += sum(len(c.token_ids) for c in out.outputs)
        return n

    # Warm-up with the same shapes (oneDNN builds a kernel per shape on first use), then forget the
    # prompts' KV blocks so that the timed run computes its prefills like the in-process runs do.
    await asyncio.gather(*(one(p, _warmup(params)) for p in prompts))
    await client.reset_prefix_cache()
    t0 = time.perf_counter()
    generated = sum(await asyncio.gather(*(one(p) for p in prompts)))
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens": generated, "tokens_per_s": generated / elapsed}


def run(args: argparse.Namespace) -> int:
    from vllm_lite.engine_core.core import EngineCore
    from vllm_lite.frontend.client import AsyncEngineClient
    from vllm_lite.tokenizer import load_tokenizer

    config: EngineConfig = EngineArgs(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
        seed=args.seed,
    ).create_engine_config()
    tokenizer = load_tokenizer(config.model_config)
    prompts = make_prompts(config.model_config.vocab_size, set(tokenizer.all_special_ids), args)
    params = workload_params(args)

    core = EngineCore(config)
    first = run_in_process(core, prompts, params, "a")
    client = AsyncEngineClient(config)
    try:
        through_client = asyncio.run(run_through_client(client, prompts, params))
    finally:
        client.shutdown()
    second = run_in_process(core, prompts, params, "b")
    core.shutdown()

    in_process = (first["tokens_per_s"] + second["tokens_per_s"]) / 2
    ratio = through_client["tokens_per_s"] / in_process
    overhead_us = (1 / through_client["tokens_per_s"] - 1 / in_process) * 1e6
    result = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "temperature": args.temperature,
        "in_process_first": first,
        "client": through_client,
        "in_process_second": second,
        "ratio_client_vs_in_process": ratio,
        "overhead_us_per_token": overhead_us,
        "in_process_drift": second["tokens_per_s"] / first["tokens_per_s"] - 1,
    }
    print(
        f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out tokens, "
        f"temperature {args.temperature}"
    )
    print(f"{'path':<38}{'output tok/s':>14}{'time s':>10}")
    for name, r in (
        ("EngineCore in-process (run 1)", first),
        ("AsyncEngineClient over ZMQ", through_client),
        ("EngineCore in-process (run 2)", second),
    ):
        print(f"{name:<38}{r['tokens_per_s']:>14.1f}{r['elapsed_s']:>10.1f}")
    print(f"client / in-process: {ratio:.3f}  ({overhead_us:+.0f} us per output token)")
    print(f"drift between the in-process runs: {result['in_process_drift']:+.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
