"""`vllm-lite serve --headless`: a node that runs DP ranks for a head node's frontend, no API.

Its engines handshake with the head directly over TCP. The node lives as long as its engines: an
engine exits when the head's frontend is gone (disconnect, or no ZMTP heartbeat), so the node
follows its head down; SIGTERM or Ctrl-C stop it too.
"""

from __future__ import annotations

import logging

from vllm_lite.config import EngineConfig
from vllm_lite.launchers.mp import MPLauncher
from vllm_lite.protocol.sockets import tcp_address
from vllm_lite.signals import exit_on_termination

logger = logging.getLogger(__name__)


def run_headless(config: EngineConfig, log_level: str = "WARNING", handshake_timeout_s: float = 600.0) -> int:
    """Start this node's ranks, wait until they have all exited, return 0."""
    pc = config.parallel_config
    if pc.data_parallel_rpc_port is None:
        raise ValueError(
            "--headless needs the head node's --data-parallel-address and --data-parallel-rpc-port"
        )
    if pc.local_size < 1:
        raise ValueError("--headless needs --data-parallel-size-local of at least 1")
    exit_on_termination()
    launcher = MPLauncher(
        pc.data_parallel_size,
        log_level=log_level,
        handshake_timeout_s=handshake_timeout_s,
        dp_size_local=pc.local_size,
        start_rank=pc.data_parallel_start_rank,
        master_ip=pc.data_parallel_address,
        headless=True,
    )
    head = tcp_address(pc.data_parallel_address, pc.data_parallel_rpc_port)
    ranks = launcher.local_ranks
    logger.warning("headless: DP ranks %d..%d for the head at %s", ranks[0], ranks[-1], head)
    try:
        launcher.start_headless(config, head)
        launcher.wait()
        for rank, process in sorted(launcher.processes.items()):
            logger.warning("headless: engine core %d exited (%s)", rank, process.returncode)
    finally:
        launcher.shutdown()
    return 0
