"""The launcher interface: start the engine cores of a deployment, watch them, stop them."""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable

import zmq

from vllm_lite.config import EngineConfig
from vllm_lite.launchers.handshake import run_handshake
from vllm_lite.protocol.messages import HandshakeAddresses, Ready

logger = logging.getLogger(__name__)

# Called once per engine core that stops without being asked to: (dp_rank, why).
DeathCallback = Callable[[int, str], None]


class EngineLauncher(abc.ABC):
    """Starts one engine core per DP rank, runs the handshake, reports deaths, shuts down.

    Subclasses say how engines run (processes, Ray actors); the handshake and the bookkeeping of
    dead engines are shared.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dead: dict[int, str] = {}
        self._on_death: DeathCallback | None = None
        self._stopping = False

    @property
    @abc.abstractmethod
    def dp_ranks(self) -> list[int]:
        """The DP ranks this launcher starts."""

    @abc.abstractmethod
    def _start_engines(self, config: EngineConfig, handshake_address: str) -> None:
        """Start every rank's engine core, pointed at the handshake address; do not wait."""

    @abc.abstractmethod
    def _start_monitor(self) -> None:
        """Begin watching the engines; call `_report_death` for each one that stops."""

    @abc.abstractmethod
    def _stop_engines(self, timeout_s: float) -> None:
        """Stop every engine core and wait for it; kill what does not stop in time."""

    def launch(
        self,
        config: EngineConfig,
        handshake_socket: zmq.Socket,
        handshake_address: str,
        addresses: HandshakeAddresses,
        on_death: DeathCallback,
        timeout_s: float,
    ) -> dict[int, Ready]:
        """Start the engines and return each rank's READY; raises EngineStartupError (and stops
        whatever started) if any rank fails or times out."""
        self._on_death = None
        self._start_engines(config, handshake_address)
        self._start_monitor()
        try:
            ready = run_handshake(handshake_socket, self.dp_ranks, addresses, self.dead_engines, timeout_s)
        except BaseException:
            self.shutdown()
            raise
        with self._lock:
            self._on_death = on_death
            early = dict(self._dead)
        for rank, why in early.items():
            on_death(rank, why)
        return ready

    def start_headless(self, config: EngineConfig, handshake_address: str) -> None:
        """Start this node's engines pointed at a remote frontend's handshake; no handshake
        here (the engines do theirs with the frontend directly)."""
        self._start_engines(config, handshake_address)
        self._start_monitor()

    def dead_engines(self) -> dict[int, str]:
        """Ranks whose engine has stopped, with the reason."""
        with self._lock:
            return dict(self._dead)

    def _report_death(self, rank: int, why: str) -> None:
        with self._lock:
            if self._stopping or rank in self._dead:
                return
            self._dead[rank] = why
            callback = self._on_death
        logger.error("engine core %d died: %s", rank, why)
        if callback is not None:
            callback(rank, why)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop all engines (idempotent); deaths during shutdown are not reported."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._stop_engines(timeout_s)
