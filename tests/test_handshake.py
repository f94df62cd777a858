"""The startup handshake and the engine-core busy loop's failure paths, over real ipc sockets.

The engines here are threads speaking the protocol (the real engine process is covered by
test_client.py); they let each failure be provoked exactly.
"""

from __future__ import annotations

import shutil
import threading
import time

import msgspec
import pytest
import zmq

from vllm_lite.engine_core.proc import EngineCoreProc
from vllm_lite.errors import EngineStartupError
from vllm_lite.launchers.handshake import run_handshake
from vllm_lite.protocol.codec import Decoder, encode
from vllm_lite.protocol.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineStats,
    FromEngine,
    HandshakeAddresses,
    HandshakeToEngine,
    Hello,
    Ready,
    UtilityCall,
    UtilityResult,
)
from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.protocol.sockets import ipc_address, make_socket, new_runtime_dir

ADDRESSES = HandshakeAddresses(input_address="ipc:///nowhere/in", output_address="ipc:///nowhere/out")


@pytest.fixture
def runtime_dir():
    path = new_runtime_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def router(runtime_dir):
    context = zmq.Context()
    address = ipc_address(runtime_dir, "handshake")
    socket = make_socket(context, zmq.ROUTER, address, bind=True)
    yield socket, address, context
    socket.close()
    context.term()


def ready(rank: int, config_hash: str = "abc") -> Ready:
    return Ready(
        dp_rank=rank, max_model_len=128, num_kv_blocks=10, block_size=16, version="0", config_hash=config_hash
    )


def fake_engine(context: zmq.Context, address: str, rank: int, script: list) -> threading.Thread:
    """A thread that connects as `rank` and plays `script`: messages or raw bytes to send, or
    'await' to wait for the addresses."""

    def play() -> None:
        socket = make_socket(context, zmq.DEALER, address, bind=False, identity=str(rank).encode())
        decoder: Decoder[HandshakeToEngine] = Decoder(HandshakeToEngine, "test")
        for step in script:
            if step == "await":
                assert socket.poll(5000)
                assert isinstance(decoder.decode(socket.recv()), HandshakeAddresses)
            else:
                socket.send(step if isinstance(step, bytes) else encode(step))
        time.sleep(0.5)
        socket.close()

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    return thread


def no_deaths() -> dict[int, str]:
    return {}


def test_two_ranks_complete_the_handshake_despite_garbage(router):
    socket, address, context = router
    for rank in (0, 1):
        script = [b"\x00garbage", Hello(rank, True, False), "await", ready(rank)]
        fake_engine(context, address, rank, script)
    result = run_handshake(socket, [0, 1], ADDRESSES, no_deaths, timeout_s=10)
    assert sorted(result) == [0, 1] and result[1].num_kv_blocks == 10


def test_a_rank_that_never_answers_times_out_by_name(router):
    socket, address, context = router
    fake_engine(context, address, 0, [Hello(0, True, False), "await", ready(0)])
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError, match=r"engine cores \[1\] did not become ready within 1 s"):
        run_handshake(socket, [0, 1], ADDRESSES, no_deaths, timeout_s=1)
    assert time.monotonic() - t0 < 3


def test_a_dead_rank_fails_the_startup_at_once(router):
    socket, address, context = router
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError, match="engine core 0 died during startup .killed by SIGKILL."):
        run_handshake(socket, [0], ADDRESSES, lambda: {0: "killed by SIGKILL"}, timeout_s=60)
    assert time.monotonic() - t0 < 2


def test_a_rank_that_reports_its_failure_is_quoted(router):
    socket, address, context = router
    fake_engine(
        context, address, 0, [Hello(0, True, False), "await", EngineDead(0, "startup failed: out of memory")]
    )
    with pytest.raises(EngineStartupError, match="out of memory"):
        run_handshake(socket, [0], ADDRESSES, no_deaths, timeout_s=10)


def test_ranks_that_disagree_on_the_config_are_refused(router):
    socket, address, context = router
    fake_engine(context, address, 0, [Hello(0, True, False), "await", ready(0, "abc")])
    fake_engine(context, address, 1, [Hello(1, True, False), "await", ready(1, "xyz")])
    with pytest.raises(EngineStartupError, match="disagrees"):
        run_handshake(socket, [0, 1], ADDRESSES, no_deaths, timeout_s=10)


def test_an_impostor_identity_is_ignored(router):
    """A peer whose socket identity does not match the rank it claims gets no addresses."""
    socket, address, context = router
    fake_engine(context, address, 5, [Hello(0, True, False)])
    with pytest.raises(EngineStartupError, match="did not become ready"):
        run_handshake(socket, [0], ADDRESSES, no_deaths, timeout_s=1)


# ---------------------------------------------------------------------------- the busy loop


class FailingCore:
    """Just enough of EngineCore for the busy loop; `step` raises once a request is queued."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.requests.append(request.req_id)

    def abort_requests(self, req_ids: list[str]) -> list:
        self.aborted.extend(req_ids)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        if self.requests:
            raise RuntimeError("simulated CUDA error")
        return []

    def get_stats(self):
        return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0)

    @property
    def scheduler(self):
        return self


def test_busy_loop_refuses_bad_requests_alone_and_reports_a_fatal_error(runtime_dir):
    context = zmq.Context()
    addresses = HandshakeAddresses(ipc_address(runtime_dir, "in"), ipc_address(runtime_dir, "out"))
    frontend_in = make_socket(context, zmq.ROUTER, addresses.input_address, bind=True)
    frontend_out = make_socket(context, zmq.PULL, addresses.output_address, bind=True)
    core = FailingCore()
    core.kv_cache_manager = core
    core.reset_prefix_cache = lambda: None
    gone = threading.Event()
    proc = EngineCoreProc(core, 3, addresses, context, on_frontend_gone=gone.set)
    exits: list[BaseException] = []

    def serve() -> None:
        try:
            proc.run_busy_loop()
        except SystemExit as exc:
            exits.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    decoder: Decoder[FromEngine] = Decoder(FromEngine, "test")
    try:
        assert frontend_in.poll(5000)
        identity, registration = frontend_in.recv_multipart()
        assert (identity, registration) == (b"3", b"")

        def send(message) -> None:
            frontend_in.send_multipart([b"3", encode(message)])

        def receive():
            while True:
                assert frontend_out.poll(5000)
                message = decoder.decode(frontend_out.recv())
                if not (isinstance(message, EngineCoreOutputs) and message.is_heartbeat):
                    return message

        send(UtilityCall(call_id=1, method="no_such_method"))
        reply = receive()
        assert isinstance(reply, UtilityResult) and "unknown utility method" in reply.error
        send(EngineCoreRequest("bad", [], SamplingParams(), 0.0))
        refused = receive()
        assert isinstance(refused, EngineCoreOutputs)
        assert refused.outputs[0].req_id == "bad" and "empty" in refused.outputs[0].error
        # A request frame that fails validation is still answered, by its req_id.
        frontend_in.send_multipart(
            [b"3", msgspec.msgpack.encode({"type": "request", "req_id": "broken", "x": 1})]
        )
        malformed = receive()
        assert isinstance(malformed, EngineCoreOutputs)
        assert malformed.outputs[0].req_id == "broken" and malformed.outputs[0].error == "malformed request"
        send(EngineCoreAbort(["x"]))
        after_abort = receive()  # no tokens, fresh load figures
        assert isinstance(after_abort, EngineCoreOutputs) and after_abort.outputs == []
        assert after_abort.stats is not None
        send(EngineCoreRequest("good", [1, 2], SamplingParams(), 0.0))
        dead = receive()
        assert isinstance(dead, EngineDead)
        assert dead.engine_index == 3 and "simulated CUDA error" in dead.reason
        thread.join(10)
        assert exits and exits[0].code == 1
        assert core.aborted == ["x"]
        assert not gone.is_set()
    finally:
        frontend_in.close()
        frontend_out.close()
    # The frontend's socket is gone: the engine notices (a real engine process then exits).
    assert gone.wait(15)
    # No context.term(): the engine's input thread still owns a socket, as in a real engine
    # process, which simply exits.
