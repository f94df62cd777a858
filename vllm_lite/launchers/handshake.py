"""The frontend's side of the startup handshake: HELLO -> addresses -> READY from every rank."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from vllm_lite.errors import EngineStartupError
from vllm_lite.protocol.codec import Decoder, encode
from vllm_lite.protocol.messages import EngineDead, HandshakeAddresses, HandshakeToFrontend, Hello, Ready

logger = logging.getLogger(__name__)

POLL_MS = 100


def run_handshake(
    socket: zmq.Socket,
    dp_ranks: list[int],
    addresses: HandshakeAddresses,
    dead_engines: Callable[[], dict[int, str]],
    timeout_s: float,
) -> dict[int, Ready]:
    """Answer every rank's HELLO with the data-socket addresses (and the DP group's store, once
    rank 0 has published its port) and collect their READYs.

    `socket` is the bound ROUTER; `dead_engines` reports ranks whose process has exited, so a rank
    that dies while loading its model fails the startup at once instead of after the timeout.
    """
    decoder: Decoder[HandshakeToFrontend] = Decoder(HandshakeToFrontend, "handshake")
    expected = set(dp_ranks)
    ready: dict[int, Ready] = {}
    # With DP > 1 every rank needs the port DP rank 0 bound for the group's store: HELLOs wait
    # for rank 0's before they are answered.
    master_port: int | None = None if len(expected) > 1 else 0
    unanswered: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(ready) < len(expected):
        if socket.poll(POLL_MS, zmq.POLLIN):
            identity, frame = socket.recv_multipart()[:2]
            message = decoder.decode(frame)
            rank = getattr(message, "dp_rank", getattr(message, "engine_index", None))
            if rank not in expected or identity != str(rank).encode():
                logger.warning("handshake: ignored a message from unexpected peer %r: %r", identity, message)
            elif isinstance(message, Hello):
                if rank == 0 and master_port is None:
                    master_port = message.dp_master_port
                unanswered.append(identity)
                if master_port is not None:
                    reply = encode(msgspec.structs.replace(addresses, dp_master_port=master_port))
                    for peer in unanswered:
                        socket.send_multipart([peer, reply])
                    unanswered.clear()
            elif isinstance(message, Ready):
                ready[rank] = message
            elif isinstance(message, EngineDead):
                raise EngineStartupError(f"engine core {rank} failed to start: {message.reason}")
            continue
        dead = {r: why for r, why in dead_engines().items() if r in expected and r not in ready}
        if dead:
            # It may have sent an EngineDead with the cause just before exiting: prefer that.
            if socket.poll(POLL_MS, zmq.POLLIN):
                continue
            rank, why = min(dead.items())
            raise EngineStartupError(f"engine core {rank} died during startup ({why}); see its log above")
        if time.monotonic() > deadline:
            missing = sorted(expected - set(ready))
            raise EngineStartupError(f"engine cores {missing} did not become ready within {timeout_s:.0f} s")
    _check_agreement(ready)
    return ready


def _check_agreement(ready: dict[int, Ready]) -> None:
    """Every rank must serve the same model the same way, or outputs would depend on the rank."""
    first = ready[min(ready)]
    for rank, r in ready.items():
        if (r.version, r.config_hash, r.max_model_len, r.block_size) != (
            first.version,
            first.config_hash,
            first.max_model_len,
            first.block_size,
        ):
            raise EngineStartupError(f"engine core {rank} disagrees with rank {min(ready)}: {r} vs {first}")
