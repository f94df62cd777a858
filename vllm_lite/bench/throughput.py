"""`vllm-lite bench throughput`: offline generation throughput, side by side with HF transformers
and against this machine's fp32 roofline, all measured in one run.

Roofline: the measured fp32 matmul rate divided by the FLOPs one generated token costs at the very
least (2 x parameters): the tokens/s a perfect engine would reach if every FLOP were a peak-rate
matmul FLOP. Absolute times on shared machines are noise; the ratios are the result.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from vllm_lite.config import DEFAULT_MODEL, EngineArgs


def add_workload_args(p: argparse.ArgumentParser, input_len: int) -> None:
    """The flags every offline benchmark shares: model, prompt set, lengths, engine limits."""
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline tokens/s vs HF transformers and the roofline")
    add_workload_args(p, input_len=128)
    p.add_argument(
        "--dataset",
        choices=("random", "fixed"),
        default="random",
        help="random token prompts, or one fixed prompt repeated (prefix-cache friendly)",
    )
    p.add_argument(
        "--hf-backend",
        choices=("generate_batch", "generate", "none"),
        default="generate_batch",
        help="the HF transformers baseline: continuous batching, padded generate, or none",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="compare N engine cores with one, both through AsyncEngineClient (no HF, no roofline)",
    )
    p.set_defaults(func=run)


def make_prompts(vocab_size: int, special_ids: set[int], args: argparse.Namespace) -> list[list[int]]:
    """Random token prompts (no special tokens), or one fixed prompt repeated."""
    rng = random.Random(args.seed)
    usable = [t for t in range(vocab_size) if t not in special_ids]
    if args.dataset == "fixed":
        fixed = [usable[rng.randrange(len(usable))] for _ in range(args.input_len)]
        return [list(fixed) for _ in range(args.num_prompts)]
    return [
        [usable[rng.randrange(len(usable))] for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]


def measure_matmul_flops(seconds: float = 1.5, size: int = 2048) -> dict[str, float]:
    """Sustained fp32 FLOP/s of a large square matmul on this machine, best of several runs, for
    torch's default GEMM and for the oneDNN packed GEMM vllm-lite's linear layers use on CPU. The
    roofline takes the faster: a bound must hold for the kernels the engine really runs."""
    from vllm_lite.models.layers import gemm

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    kernels = {"torch.mm": lambda: a @ b}
    packed = gemm.prepack(b)
    if packed is not None:
        kernels["onednn_packed"] = lambda: gemm.linear(a, b, None, packed)
    rates = {}
    for name, fn in kernels.items():
        for _ in range(2):
            fn()
        best = 0.0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            fn()
            best = max(best, 2 * size**3 / (time.perf_counter() - t0))
        rates[name] = best
    return rates


def run_vllm_lite(prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from vllm_lite.engine_core.llm import LLM
    from vllm_lite.protocol.sampling_params import SamplingParams

    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
        seed=args.seed,
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up: kernels, allocator
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    model = llm.engine.executor.worker.runner.model
    num_params = sum(p.numel() for p in model.parameters())
    head_params = model.lm_head.weight.numel()
    del llm
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "num_params": num_params,
        "lm_head_params": head_params,
    }


def run_hf(prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from vllm_lite.config import resolve_model

    source = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, dtype=torch.float32, **source.from_pretrained_kwargs()
    ).eval()
    sample = args.temperature > 0
    gen = GenerationConfig(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=sample,
        temperature=args.temperature if sample else None,
        top_k=None,
        top_p=None,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.eos_token_id,
    )
    torch.manual_seed(args.seed)
    warmup = GenerationConfig(**{**gen.to_dict(), "max_new_tokens": 4, "min_new_tokens": 4})
    if args.hf_backend == "generate_batch":  # warm-up, as for vllm-lite: not timed
        model.generate_batch(inputs=prompts[:2], generation_config=warmup)
    else:
        model.generate(torch.tensor(prompts[:2]), generation_config=warmup)
    t0 = time.perf_counter()
    if args.hf_backend == "generate_batch":
        results = model.generate_batch(inputs=prompts, generation_config=gen)
        generated = sum(len(r.generated_tokens) for r in results.values())
    else:
        batch = torch.tensor(prompts)  # equal-length prompts: no padding needed
        out = model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=gen)
        generated = int(out[:, batch.shape[1] :].numel())
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens": generated}


def run(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = EngineArgs(model=args.model).create_engine_config()
    from vllm_lite.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model_config)
    prompts = make_prompts(config.model_config.vocab_size, set(tokenizer.all_special_ids), args)
    if args.data_parallel_size > 1:
        from vllm_lite.bench.dp import run_dp_comparison

        return run_dp_comparison(args, prompts)

    ours = run_vllm_lite(prompts, args)
    ours["tokens_per_s"] = ours["output_tokens"] / ours["elapsed_s"]
    rates = measure_matmul_flops()
    flops = max(rates.values())
    roofline = flops / (2 * ours["num_params"])
    # The same bound for this workload: each output token also pays for input_len / output_len prompt
    # tokens, which run every layer but the LM head (only a prompt's last token needs logits).
    prompt_flops = 2 * (ours["num_params"] - ours["lm_head_params"]) * args.input_len / args.output_len
    workload_bound = flops / (2 * ours["num_params"] + prompt_flops)
    result: dict[str, Any] = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dataset": args.dataset,
        "temperature": args.temperature,
        "threads": torch.get_num_threads(),
        "vllm_lite": ours,
        "matmul_gflops": flops / 1e9,
        "matmul_gflops_by_kernel": {k: v / 1e9 for k, v in rates.items()},
        "roofline_tokens_per_s": roofline,
        "ratio_vs_roofline": ours["tokens_per_s"] / roofline,
        "workload_bound_tokens_per_s": workload_bound,
        "ratio_vs_workload_bound": ours["tokens_per_s"] / workload_bound,
    }
    if args.hf_backend != "none":
        hf = run_hf(prompts, args)
        hf["tokens_per_s"] = hf["output_tokens"] / hf["elapsed_s"]
        result["hf"] = {"backend": args.hf_backend, **hf}
        result["ratio_vs_hf"] = ours["tokens_per_s"] / hf["tokens_per_s"]
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def print_table(r: dict[str, Any]) -> None:
    ours = r["vllm_lite"]
    print(
        f"\n{r['num_prompts']} prompts x {r['input_len']} in / {r['output_len']} out tokens "
        f"({r['dataset']}, temperature {r['temperature']}), {r['threads']} threads, "
        f"{ours['num_params'] / 1e6:.1f}M params"
    )
    print(f"{'engine':<34}{'output tok/s':>14}{'time s':>10}")
    print(f"{'vllm-lite':<34}{ours['tokens_per_s']:>14.1f}{ours['elapsed_s']:>10.1f}")
    if "hf" in r:
        hf = r["hf"]
        print(f"{'HF transformers ' + hf['backend']:<34}{hf['tokens_per_s']:>14.1f}{hf['elapsed_s']:>10.1f}")
    kernels = ", ".join(f"{k} {v:.0f}" for k, v in r["matmul_gflops_by_kernel"].items())
    print(
        f"{'roofline (fp32 matmul / 2P)':<34}{r['roofline_tokens_per_s']:>14.1f}"
        f"{'':>10}  (best fp32 matmul GFLOP/s: {kernels})"
    )
    if "hf" in r:
        print(f"vllm-lite / HF:       {r['ratio_vs_hf']:.2f}x")
    print(f"vllm-lite / roofline: {r['ratio_vs_roofline']:.2%}")
    print(
        f"vllm-lite / roofline incl. prompt FLOPs ({r['workload_bound_tokens_per_s']:.1f} tok/s): "
        f"{r['ratio_vs_workload_bound']:.2%}"
    )
