"""The engine-core process: handshake, then a busy loop around `EngineCore` fed by ZMQ IO threads.

Threads of one engine-core process:
- main: the busy loop (drain the input queue, step, queue the outputs). Torch releases the GIL in
  its kernels, so the IO threads run while the model does.
- input: receives frames from the frontend's ROUTER, decodes them (bad frames are dropped and
  logged by the codec) and queues them for the busy loop.
- output: encodes and sends each step's `EngineCoreOutputs` on the PUSH socket.
- watchdog: exits the process when its parent dies (no orphans, even mid-step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_lite.config import EngineConfig
from vllm_lite.dp.env import DPEnv
from vllm_lite.dp.group import DPGroup, create_store
from vllm_lite.engine_core.bootstrap import start_parent_watchdog
from vllm_lite.engine_core.core import EngineCore
from vllm_lite.protocol.messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineStats,
    FinishReason,
    HandshakeAddresses,
    HandshakeToEngine,
    Hello,
    Ready,
    ToEngine,
    UtilityCall,
    UtilityResult,
)
from vllm_lite.protocol.sockets import MessageReceiver, MessageSender, make_socket

logger = logging.getLogger(__name__)

# How long a fatal error's EngineDead notice may take to leave before the process exits anyway.
FLUSH_ON_EXIT_MS = 2000
HEARTBEAT_IVL_MS = 1000
OUTPUT_HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_MS = 5000
# A frontend that disconnected and is not back after this long is gone for good.
FRONTEND_GRACE_S = 3.0
# DP lockstep: how long an idle rank waits for input before the ranks next agree on "any work?".
LOCKSTEP_IDLE_WAIT_S = 0.02


@dataclass(frozen=True)
class EngineIdentity:
    """Where an engine core reports during startup and what keeps it alive; its DP rank comes
    from the DP env vars (`vllm_lite.dp.env`), the launch contract."""

    handshake_address: str
    # The process that must be alive for this engine to live (None: no watch, e.g. a Ray actor).
    parent_pid: int | None
    local: bool = True
    headless: bool = False
    handshake_timeout_s: float = 600.0
    log_level: str = "WARNING"
    # CPUs this engine may run on (None: all); the launcher gives each local DP rank its share.
    cpu_ids: tuple[int, ...] | None = None


def config_hash(config: EngineConfig) -> str:
    """A digest of what must agree between the DP ranks and the frontend (model, lengths, cache)."""
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    fields = (mc.source, mc.dtype, mc.max_model_len, mc.tokenizer, cc.block_size, sc.max_model_len)
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def run_engine_core(config: EngineConfig, identity: EngineIdentity) -> None:
    """Process entry point: handshake, build the engine, serve until killed or the parent dies."""
    from vllm_lite import __version__

    dp = DPEnv.from_env()
    dp_rank = dp.rank
    logging.basicConfig(
        level=identity.log_level.upper(), format=f"%(levelname)s engine{dp_rank} %(name)s: %(message)s"
    )
    if identity.parent_pid is not None:
        start_parent_watchdog(identity.parent_pid)
    # Ctrl-C reaches the whole process group; the frontend decides when engines stop (SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if identity.cpu_ids:
        # DP ranks on one machine each get their own cores: threads of two ranks sharing a core
        # spin against each other in every OpenMP barrier.
        os.sched_setaffinity(0, identity.cpu_ids)
    # DP rank 0 hosts the DP group's store on a port it binds itself, then publishes it.
    store = create_store(dp, dp.master_port) if dp.size > 1 and dp.rank == 0 else None
    context = zmq.Context()
    handshake = make_socket(
        context, zmq.DEALER, identity.handshake_address, bind=False, identity=str(dp_rank).encode()
    )
    sender = MessageSender(handshake)
    sender.send(
        Hello(
            dp_rank=dp_rank,
            local=identity.local,
            headless=identity.headless,
            dp_master_port=store.port if store is not None else 0,
        )
    )
    receiver: MessageReceiver[HandshakeToEngine] = MessageReceiver(handshake, HandshakeToEngine, "handshake")
    addresses = _wait_for_addresses(receiver, identity.handshake_timeout_s)
    dp_group = None
    lockstep = config.parallel_config.data_parallel_lockstep and dp.size > 1
    try:
        if dp.size > 1:
            if store is None:
                master = dataclasses.replace(dp, master_ip=addresses.dp_master_ip)
                store = create_store(master, addresses.dp_master_port)
            dp_group = DPGroup.create(dp, store)
            dp_group.check_agreement("the engine config", config_hash(config))
        core = EngineCore(config, reserve_dummy_block=lockstep)
    except BaseException as exc:
        logger.exception("engine core %d failed to start", dp_rank)
        sender.send(EngineDead(engine_index=dp_rank, reason=f"startup failed: {exc!r}"))
        handshake.close(linger=FLUSH_ON_EXIT_MS)
        context.term()
        sys.exit(1)
    proc = EngineCoreProc(core, dp_rank, addresses, context, dp_group=dp_group, lockstep=lockstep)
    sender.send(
        Ready(
            dp_rank=dp_rank,
            max_model_len=config.scheduler_config.max_model_len,
            num_kv_blocks=core.num_kv_blocks,
            block_size=config.cache_config.block_size,
            version=__version__,
            config_hash=config_hash(config),
        )
    )
    handshake.close(linger=FLUSH_ON_EXIT_MS)
    code = 1
    try:
        proc.run_busy_loop()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        core.shutdown()
        logging.shutdown()
        # No interpreter teardown: the C++ destructors of the DP group's gloo threads can abort
        # when the other ranks exit at the same moment, turning a clean stop into a SIGABRT.
        os._exit(code)


def _wait_for_addresses(receiver: MessageReceiver[HandshakeToEngine], timeout_s: float) -> HandshakeAddresses:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if receiver.poll(100):
            message = receiver.recv()
            if isinstance(message, HandshakeAddresses):
                return message
    logger.error("no handshake reply from the frontend within %.0f s; exiting", timeout_s)
    sys.exit(1)


def _request_id_of(frame: bytes) -> str | None:
    """The req_id of an undecodable request frame, if the frame is msgpack with one."""
    try:
        message = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if (
        isinstance(message, dict)
        and message.get("type") == "request"
        and isinstance(message.get("req_id"), str)
    ):
        return message["req_id"]
    return None


class EngineCoreProc:
    """Serves one EngineCore over the frontend's request and output sockets."""

    def __init__(
        self,
        core: EngineCore,
        engine_index: int,
        addresses: HandshakeAddresses,
        context: zmq.Context,
        on_frontend_gone: Callable[[], None] = lambda: os._exit(0),
        dp_group: DPGroup | None = None,
        lockstep: bool = False,
    ) -> None:
        self.core = core
        self.engine_index = engine_index
        self._on_frontend_gone = on_frontend_gone
        self.dp_group = dp_group
        self.lockstep = lockstep
        self.num_steps = 0
        self.input_queue: queue.Queue[ToEngine] = queue.Queue()
        self.output_queue: queue.Queue[msgspec.Struct | None] = queue.Queue()
        self._input_socket = make_socket(
            context,
            zmq.DEALER,
            addresses.input_address,
            bind=False,
            identity=str(engine_index).encode(),
            # ZMTP heartbeats: a frontend that vanished without closing (node down, network cut)
            # shows up as a disconnect within HEARTBEAT_TIMEOUT_MS.
            options={zmq.HEARTBEAT_IVL: HEARTBEAT_IVL_MS, zmq.HEARTBEAT_TIMEOUT: HEARTBEAT_TIMEOUT_MS},
        )
        self._frontend_events = self._input_socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        threading.Thread(target=self._watch_frontend, name="frontend-watch", daemon=True).start()
        self._output_socket = make_socket(context, zmq.PUSH, addresses.output_address, bind=False)
        threading.Thread(target=self._input_loop, name="engine-input", daemon=True).start()
        self._output_thread = threading.Thread(target=self._output_loop, name="engine-output", daemon=True)
        self._output_thread.start()
        self._utilities = {
            "get_stats": self._stats,
            "reset_prefix_cache": self.core.scheduler.kv_cache_manager.reset_prefix_cache,
            "ping": lambda: "pong",
        }

    def run_busy_loop(self) -> None:
        """Serve forever; on a fatal error tell the frontend (EngineDead) and exit non-zero."""
        try:
            while True:
                if self.dp_group is not None and self.lockstep:
                    self._lockstep_iteration(self.dp_group)
                else:
                    self._process_input(wait_s=0 if self.core.has_unfinished_requests() else None)
                    if self.core.has_unfinished_requests():
                        self._step()
        except SystemExit:
            raise
        except BaseException as exc:
            logger.error("engine core %d failed:\n%s", self.engine_index, traceback.format_exc())
            self.output_queue.put(
                EngineDead(engine_index=self.engine_index, reason=f"{type(exc).__name__}: {exc}")
            )
            self.output_queue.put(None)
            self._output_thread.join(timeout=FLUSH_ON_EXIT_MS / 1000 + 1)
            sys.exit(1)

    def _step(self) -> None:
        outputs = self.core.step()
        self.num_steps += 1
        if outputs:
            self._send_outputs(outputs)

    def _lockstep_iteration(self, dp_group: DPGroup) -> None:
        """DP lockstep: all ranks agree each iteration whether any has work; if one has, every
        rank steps (a dummy forward where there is nothing to do), so ranks stay in waves."""
        has_work = self.core.has_unfinished_requests()
        self._process_input(wait_s=0 if has_work else LOCKSTEP_IDLE_WAIT_S)
        has_work = self.core.has_unfinished_requests()
        if dp_group.all_reduce([1.0 if has_work else 0.0])[0] == 0:
            return  # nobody has work: the wave is over (or never started)
        if has_work:
            self._step()
        else:
            self.core.dummy_step()
            self.num_steps += 1

    def _process_input(self, wait_s: float | None) -> None:
        """Handle every queued message, first waiting up to `wait_s` (None: forever) for one."""
        if wait_s != 0:
            try:
                self._handle(self.input_queue.get(timeout=wait_s))
            except queue.Empty:
                return
        while True:
            try:
                message = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: ToEngine) -> None:
        if isinstance(message, EngineCoreRequest):
            try:
                self.core.add_request(message)
            except ValueError as exc:
                # One bad request never takes the engine down: it ends with an explicit error.
                failed = EngineCoreOutput(
                    req_id=message.req_id, new_token_ids=[], finish_reason=FinishReason.ABORT, error=str(exc)
                )
                self._send_outputs([failed])
        elif isinstance(message, EngineCoreAbort):
            self.core.abort_requests(message.req_ids)
            # No tokens to report, but the load changed: the balancer and /metrics should know.
            self._send_outputs([])
        elif isinstance(message, UtilityCall):
            self.output_queue.put(self._call_utility(message))

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        method = self._utilities.get(call.method)
        if method is None:
            return UtilityResult(call_id=call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            args = [msgspec.msgpack.decode(a) for a in call.args]
            result = method(*args)
            return UtilityResult(call_id=call.call_id, result=msgspec.Raw(msgspec.msgpack.encode(result)))
        except Exception as exc:
            return UtilityResult(call_id=call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _stats(self) -> EngineStats:
        return msgspec.structs.replace(self.core.get_stats(), num_steps=self.num_steps)

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self.output_queue.put(
            EngineCoreOutputs(
                engine_index=self.engine_index, outputs=outputs, stats=self._stats(), timestamp=time.time()
            )
        )

    def _watch_frontend(self) -> None:
        """Exit when the frontend is gone: disconnected and not back within FRONTEND_GRACE_S.

        This is how engines on a headless node follow their head; local engines also have the
        parent watchdog.
        """
        lost_at: float | None = None
        while True:
            if self._frontend_events.poll(250):
                event = recv_monitor_message(self._frontend_events)["event"]
                lost_at = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
            elif lost_at is not None and time.monotonic() - lost_at > FRONTEND_GRACE_S:
                logger.error("engine core %d: the frontend is gone; exiting", self.engine_index)
                self._on_frontend_gone()
                return

    def _input_loop(self) -> None:
        # An empty frame registers our identity with the frontend's ROUTER, which can route to us
        # only once it has heard from us; the frontend waits for it before sending requests.
        self._input_socket.send(b"")
        receiver: MessageReceiver[ToEngine] = MessageReceiver(self._input_socket, ToEngine, "engine input")
        while True:
            frames = self._input_socket.recv_multipart(copy=False)
            message = receiver.decoder.decode(frames[-1].buffer)
            if message is not None:
                self.input_queue.put(message)
            elif (req_id := _request_id_of(frames[-1].bytes)) is not None:
                # A request we cannot decode still gets an answer, or its client would wait forever.
                refused = EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    error="malformed request",
                )
                self.output_queue.put(
                    EngineCoreOutputs(
                        engine_index=self.engine_index, outputs=[refused], timestamp=time.time()
                    )
                )

    def _output_loop(self) -> None:
        sender = MessageSender(self._output_socket)
        # Silence longer than this means "alive, nothing to say": the frontend hears a heartbeat,
        # so a rank it cannot watch as a process (another node) is known dead when it stops.
        heartbeat = EngineCoreOutputs(engine_index=self.engine_index, outputs=[])
        while True:
            try:
                message = self.output_queue.get(timeout=OUTPUT_HEARTBEAT_S)
            except queue.Empty:
                sender.send(heartbeat)
                continue
            if message is None:
                # Give a last EngineDead time to leave before the socket goes.
                self._output_socket.close(linger=FLUSH_ON_EXIT_MS)
                return
            sender.send(message)
