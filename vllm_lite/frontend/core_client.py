"""The frontend's link to its engine cores: sockets, startup, an output thread, liveness.

No asyncio here: the output thread receives and decodes each engine step's batch and hands it to
a callback (the `AsyncEngineClient` forwards it to its event loop). Sending happens on the
caller's thread (the client's loop).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable

import zmq

from vllm_lite.config import EngineConfig
from vllm_lite.errors import EngineDeadError, EngineStartupError
from vllm_lite.launchers.base import EngineLauncher
from vllm_lite.protocol.codec import encode
from vllm_lite.protocol.messages import (
    EngineCoreOutputs,
    EngineDead,
    FromEngine,
    HandshakeAddresses,
    Ready,
    ToEngine,
)
from vllm_lite.protocol.sockets import MessageReceiver, ipc_address, make_socket, new_runtime_dir, tcp_address

logger = logging.getLogger(__name__)

OUTPUT_POLL_MS = 100
# After READY, how long each rank's input socket may take to register with our ROUTER.
REGISTER_TIMEOUT_S = 30.0
# An engine sends something at least every second (a heartbeat when idle); this much silence
# means it is dead or hung.
SILENCE_TIMEOUT_S = 10.0


class EngineCoreClient:
    """Starts the engines through a launcher and moves messages to and from them.

    `on_message(message)` is called on the output thread for every decoded frame
    (EngineCoreOutputs, UtilityResult); `on_engine_dead(rank, reason)` on whichever thread
    notices a death first (the launcher's monitor, or the output thread for an EngineDead notice).
    """

    def __init__(
        self,
        config: EngineConfig,
        launcher: EngineLauncher,
        on_message: Callable[[FromEngine], None],
        on_engine_dead: Callable[[int, str], None],
        startup_timeout_s: float,
        silence_timeout_s: float = SILENCE_TIMEOUT_S,
    ) -> None:
        self.launcher = launcher
        self.silence_timeout_s = silence_timeout_s
        self._on_message = on_message
        self._on_engine_dead = on_engine_dead
        self._stop = threading.Event()
        self._closed = False
        self.runtime_dir = new_runtime_dir()
        self.context = zmq.Context()
        try:
            self.ready = self._start(config, startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _bind(self, kind: int, name: str, tcp_host: str | None, port: int = 0) -> tuple[zmq.Socket, str]:
        """A bound socket and the address peers connect to: ipc in the runtime dir, or TCP on
        `tcp_host` (port 0: any free port)."""
        if tcp_host is None:
            address = ipc_address(self.runtime_dir, name)
            return make_socket(self.context, kind, address, bind=True), address
        wanted = tcp_address(tcp_host, port) if port else tcp_address(tcp_host, 0).rsplit(":", 1)[0] + ":*"
        try:
            socket = make_socket(self.context, kind, wanted, bind=True)
        except zmq.ZMQError as exc:
            raise EngineStartupError(f"cannot bind {wanted} for the engines' {name} socket: {exc}") from exc
        return socket, socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def _start(self, config: EngineConfig, timeout_s: float) -> dict[int, Ready]:
        pc = config.parallel_config
        # Ranks on other nodes reach us over TCP on the DP address; otherwise ipc, private to us.
        tcp_host = pc.data_parallel_address if pc.multi_node else None
        if pc.local_size < pc.data_parallel_size and pc.data_parallel_rpc_port is None:
            raise ValueError(
                "ranks on other nodes need --data-parallel-rpc-port (and --data-parallel-address)"
            )
        handshake, handshake_address = self._bind(
            zmq.ROUTER, "handshake", tcp_host, pc.data_parallel_rpc_port or 0
        )
        self.input_socket, input_address = self._bind(zmq.ROUTER, "input", tcp_host)
        # Sending to a rank that is not connected raises instead of silently dropping the frame.
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.output_socket, output_address = self._bind(zmq.PULL, "output", tcp_host)
        addresses = HandshakeAddresses(
            input_address=input_address, output_address=output_address, dp_master_ip=pc.data_parallel_address
        )
        try:
            ready = self.launcher.launch(
                config, handshake, handshake_address, addresses, self._engine_died, timeout_s
            )
        finally:
            handshake.close()
        self._wait_for_registration(sorted(ready))
        now = time.monotonic()
        self.last_heard = dict.fromkeys(ready, now)
        threading.Thread(target=self._watch_heartbeats, name="engine-heartbeats", daemon=True).start()
        self._output_thread = threading.Thread(target=self._output_loop, name="engine-outputs", daemon=True)
        self._output_thread.start()
        return ready

    def _wait_for_registration(self, ranks: list[int]) -> None:
        """Each engine's DEALER says hello on the input socket, so that our ROUTER can route to it."""
        pending = {str(r).encode() for r in ranks}
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine cores {sorted(pending)} never connected their input socket")
            dead = self.launcher.dead_engines()
            if dead:
                rank, why = min(dead.items())
                raise EngineStartupError(f"engine core {rank} died during startup ({why})")
            if self.input_socket.poll(100, zmq.POLLIN):
                pending.discard(self.input_socket.recv_multipart()[0])

    def _watch_heartbeats(self) -> None:
        """Declare dead a rank not heard from for `silence_timeout_s`: the only liveness signal
        for ranks on other nodes (local ones also have their process watched), and it catches a
        hung engine too."""
        reported: set[int] = set()
        while not self._stop.wait(0.5):
            now = time.monotonic()
            for rank, heard in list(self.last_heard.items()):
                if rank not in reported and now - heard > self.silence_timeout_s:
                    reported.add(rank)
                    self._engine_died(rank, f"no message or heartbeat for {self.silence_timeout_s:.0f} s")

    def send(self, rank: int, message: ToEngine) -> None:
        """Send a message to one engine core; raises EngineDeadError if it is gone."""
        try:
            self.input_socket.send_multipart([str(rank).encode(), encode(message)], copy=False)
        except zmq.ZMQError as exc:
            raise EngineDeadError(f"engine core {rank} is unreachable: {exc}") from exc

    def _output_loop(self) -> None:
        try:
            self._receive_outputs()
        except Exception:
            # Without this thread no output arrives: declare every engine dead rather than hang.
            logger.exception("the client's output thread failed")
            for rank in sorted(getattr(self, "ready", {0: None})):
                self._engine_died(rank, "the client's output thread failed")

    def _receive_outputs(self) -> None:
        receiver: MessageReceiver[FromEngine] = MessageReceiver(
            self.output_socket, FromEngine, "client output"
        )
        while not self._stop.is_set():
            try:
                if not receiver.poll(OUTPUT_POLL_MS):
                    continue
                message = receiver.recv()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if message is None:
                continue
            rank = getattr(message, "engine_index", None)
            if rank is not None:
                self.last_heard[rank] = time.monotonic()
            if isinstance(message, EngineCoreOutputs) and message.is_heartbeat:
                continue  # noted above, nothing for the client
            if isinstance(message, EngineDead):
                self._engine_died(message.engine_index, message.reason)
            else:
                self._on_message(message)

    def _engine_died(self, rank: int, reason: str) -> None:
        if not self._stop.is_set():
            self._on_engine_dead(rank, reason)

    def close(self) -> None:
        """Stop the engines, the output thread and the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.launcher.shutdown()
        thread = getattr(self, "_output_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        for name in ("input_socket", "output_socket"):
            socket = getattr(self, name, None)
            if socket is not None:
                socket.close()
        self.context.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
