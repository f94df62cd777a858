"""The wire: tagged msgpack round trips, and malformed frames dropped instead of crashing."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from vllm_lite.protocol.codec import Decoder, encode
from vllm_lite.protocol.messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    FromEngine,
    ToEngine,
    UtilityCall,
)
from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.protocol.sockets import (
    MessageReceiver,
    MessageSender,
    ipc_address,
    make_socket,
    new_runtime_dir,
)
from vllm_lite.protocol.step import SampleLogprobs


def test_round_trip_every_engine_bound_message():
    decoder: Decoder = Decoder(ToEngine, "test")
    messages = [
        EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, seed=3, stop=["x"]), 12.5),
        EngineCoreAbort(["r1", "r2"]),
        UtilityCall(7, "get_stats", [msgspec.Raw(encode(EngineCoreAbort([])))]),
    ]
    for message in messages:
        decoded = decoder.decode(encode(message))
        assert type(decoded) is type(message)
        if not isinstance(message, UtilityCall):
            assert decoded == message


def test_round_trip_outputs_with_logprobs_and_finish_reason():
    out = EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput(
                "a", [5], [SampleLogprobs(5, -0.1, 1, [5, 6], [-0.1, -2.0])], FinishReason.STOP, 5
            ),
            EngineCoreOutput("b", [7, 8]),
        ],
        stats=EngineStats(num_running=2, num_waiting=0, kv_cache_usage=0.25),
        timestamp=3.0,
    )
    decoded = Decoder(FromEngine, "test").decode(encode(out))
    assert decoded == out
    assert decoded.outputs[0].finish_reason is FinishReason.STOP


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        b"not msgpack at all",
        msgspec.msgpack.encode({"type": "no_such_tag", "x": 1}),
        msgspec.msgpack.encode({"type": "request", "req_id": 5}),  # wrong field type
        # A request whose sampling params fail their own validation.
        msgspec.msgpack.encode(
            {
                "type": "request",
                "req_id": "r",
                "prompt_token_ids": [1],
                "arrival_time": 0.0,
                "sampling_params": {"temperature": -1.0},
            }
        ),
    ],
)
def test_malformed_frames_decode_to_none(frame):
    decoder: Decoder = Decoder(ToEngine, "test")
    assert decoder.decode(frame) is None
    assert decoder.num_dropped == 1


def test_typed_sockets_over_ipc_drop_garbage_and_keep_going(tmp_path):
    context = zmq.Context()
    address = ipc_address(str(tmp_path), "input")
    pull = make_socket(context, zmq.PULL, address, bind=True)
    push = make_socket(context, zmq.PUSH, address, bind=False)
    try:
        receiver: MessageReceiver = MessageReceiver(pull, ToEngine, "engine input")
        push.send(b"\x00\x01garbage")
        MessageSender(push).send(EngineCoreAbort(["x"]))
        assert receiver.poll(2000)
        assert receiver.recv() is None
        assert receiver.poll(2000)
        assert receiver.recv() == EngineCoreAbort(["x"])
    finally:
        push.close()
        pull.close()
        context.term()


def test_runtime_dir_is_private():
    import os
    import stat

    path = new_runtime_dir()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    finally:
        os.rmdir(path)
