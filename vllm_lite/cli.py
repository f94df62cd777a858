"""`vllm-lite` command line: `generate` (offline), `bench throughput`, and `serve` (coming)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vllm_lite.config import EngineArgs


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline for one or more prompts")
    EngineArgs.add_cli_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from vllm_lite.engine_core.llm import LLM
    from vllm_lite.protocol.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(f"--- {prompt!r}\n{out.outputs[0].text}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /version, /metrics).",
    )
    EngineArgs.add_cli_args(p)
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    server.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (or $VLLM_LITE_API_KEY)"
    )
    server.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted",
    )
    server.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        choices=("debug", "info", "warning", "error"),
        help="log level of the server and its engines (default: warning)",
    )
    dp = p.add_argument_group("data parallel")
    dp.add_argument(
        "--data-parallel-backend", "-dpb", default="mp", choices=("mp", "ray"), help="how engine cores start"
    )
    dp.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        default=None,
        help="DP ranks on this node (default: all)",
    )
    dp.add_argument(
        "--data-parallel-address",
        "-dpa",
        default="127.0.0.1",
        help="the head node's address: engines of other nodes connect to it (default: %(default)s)",
    )
    dp.add_argument(
        "--data-parallel-rpc-port",
        "-dpp",
        type=int,
        default=None,
        help="the head's handshake port (multi-node)",
    )
    dp.add_argument(
        "--data-parallel-start-rank",
        "-dpr",
        type=int,
        default=0,
        help="first DP rank of this node (headless)",
    )
    dp.add_argument(
        "--headless", action="store_true", help="run this node's engine cores only, no API server"
    )
    dp.add_argument(
        "--data-parallel-lockstep",
        action="store_true",
        help="ranks step together in waves; idle ranks run dummy batches (what MoE expert parallelism needs)",
    )
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    if args.headless:
        from vllm_lite.launchers.headless import run_headless

        config = EngineArgs.from_cli_args(args).create_engine_config()
        return run_headless(config, getattr(args, "log_level", "warning").upper())
    from vllm_lite.frontend.openai.api_server import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-lite", description="vllm-lite: a data-parallel LLM engine")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    bench = sub.add_parser("bench", help="benchmarks that report ratios measured side by side")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from vllm_lite.bench import client, throughput

    throughput.add_parser(bench_sub)
    client.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


# glibc's malloc then backs its large arenas with transparent huge pages: model weights and step
# activations are streamed every step, and on 4 KiB pages that measured ~10% slower end to end.
# The tunable is read only at process start, hence the one re-exec of the command.
_MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"


def entry() -> None:
    """Console-script entry point: set process-level malloc tuning, then run `main`."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if sys.platform.startswith("linux") and "glibc.malloc.hugetlb" not in tunables:
        os.environ["GLIBC_TUNABLES"] = f"{tunables}:{_MALLOC_TUNABLE}" if tunables else _MALLOC_TUNABLE
        try:
            os.execv(sys.executable, [sys.executable, "-m", "vllm_lite.cli", *sys.argv[1:]])
        except OSError:
            pass  # cannot re-exec: run as we are, just without the tuning
    sys.exit(main())


if __name__ == "__main__":
    entry()
