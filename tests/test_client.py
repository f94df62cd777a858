"""AsyncEngineClient end to end: a real engine-core process, real ZMQ sockets, the bundled model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import psutil
import pytest
import zmq

from vllm_lite import AsyncEngineClient, EngineArgs, EngineDeadError, RequestError, SamplingParams
from vllm_lite.errors import EngineStartupError
from vllm_lite.protocol.codec import encode
from vllm_lite.protocol.messages import EngineCoreAbort

pytestmark = pytest.mark.e2e

ENGINE_KWARGS = {"model": "smollm2-135m", "num_kv_blocks": 1024, "max_model_len": 1024}
GREEDY = {"temperature": 0.0}


def run(coro, timeout: float = 300):
    """Run a coroutine on a fresh loop with a hard bound: a hang fails the test instead of CI."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def client():
    c = AsyncEngineClient.from_engine_args(EngineArgs(**ENGINE_KWARGS))
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def offline():
    from vllm_lite import LLM

    return LLM(**ENGINE_KWARGS)


async def collect(client: AsyncEngineClient, prompt, params: SamplingParams, **kwargs):
    """Every output of one request, in order."""
    return [out async for out in client.generate(prompt, params, **kwargs)]


async def wait_until_idle(client: AsyncEngineClient, timeout: float = 5.0):
    """Engine stats once nothing runs and no KV block is held (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await client.get_engine_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.05)


def engine_pid(client: AsyncEngineClient) -> int:
    return client._launcher.processes[0].pid


# ------------------------------------------------------------------------------ must hold 1


def test_100_concurrent_requests_exact_length_and_equal_to_offline(client, offline):
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(100)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)

    async def main():
        return await asyncio.gather(*(collect(client, p, params) for p in prompts))

    results = run(main())
    expected = offline.generate(prompts, params)
    for prompt, outs, ref in zip(prompts, results, expected, strict=True):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert final.prompt == prompt
        sample = final.outputs[0]
        assert len(sample.token_ids) == 12
        assert sample.finish_reason == "length"
        assert sample.token_ids == ref.outputs[0].token_ids
        assert sample.text == ref.outputs[0].text


def test_delta_outputs_concatenate_to_the_cumulative_text(client):
    prompt = [{"role": "user", "content": "Write one sentence about Paris in French, with accents."}]

    async def main():
        deltas = await collect(client, prompt, SamplingParams(max_tokens=40, output_kind="delta", **GREEDY))
        cumulative = await collect(client, prompt, SamplingParams(max_tokens=40, **GREEDY))
        final_only = await collect(
            client, prompt, SamplingParams(max_tokens=40, output_kind="final_only", **GREEDY)
        )
        return deltas, cumulative, final_only

    deltas, cumulative, final_only = run(main())
    text = "".join(o.outputs[0].text for o in deltas if o.outputs)
    ids = [t for o in deltas for c in o.outputs for t in c.token_ids]
    assert len(deltas) > 1 and len(final_only) == 1
    assert text == cumulative[-1].outputs[0].text == final_only[0].outputs[0].text
    assert ids == cumulative[-1].outputs[0].token_ids
    assert "\ufffd" not in text
    # Each cumulative output extends the previous one.
    texts = [o.outputs[0].text for o in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


def test_multibyte_text_streams_without_replacement_chars(client):
    prompt = [
        {"role": "user", "content": "Réponds en japonais: 日本語で「こんにちは」と書いて、絵文字👍も使って。"}
    ]

    async def main():
        return await collect(client, prompt, SamplingParams(max_tokens=48, output_kind="delta", **GREEDY))

    outs = run(main())
    tokenizer = client.tokenizer
    ids = [t for o in outs for c in o.outputs for t in c.token_ids]
    streamed = "".join(c.text for o in outs for c in o.outputs)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in c.text for o in outs[:-1] for c in o.outputs)


def test_stop_strings_end_the_request_with_stop(client, offline):
    prompt = "The days of the week are Monday, Tuesday,"
    base = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)
    reference = offline.generate(prompt, base)[0].outputs[0].text
    # A stop string from the middle of the reference text (it spans a token boundary or not).
    stop = reference[8:14]
    assert stop and stop in reference
    before = reference[: reference.index(stop)]

    async def main():
        excl = await collect(client, prompt, msgspec.structs.replace(base, stop=[stop]))
        incl = await collect(
            client, prompt, msgspec.structs.replace(base, stop=[stop], include_stop_str_in_output=True)
        )
        stream = await collect(
            client, prompt, msgspec.structs.replace(base, stop=[stop], output_kind="delta")
        )
        return excl[-1].outputs[0], incl[-1].outputs[0], stream

    excl, incl, stream = run(main())
    assert (excl.text, excl.finish_reason, excl.stop_reason) == (before, "stop", stop)
    assert incl.text == before + stop
    assert len(excl.token_ids) < 30
    # Streamed deltas never leak the start of the stop string.
    assert "".join(c.text for o in stream for c in o.outputs) == before
    run(wait_until_idle(client))


def test_eos_ends_with_stop_and_n_samples_are_indexed(client):
    async def main():
        eos = await collect(
            client, [{"role": "user", "content": "Say yes."}], SamplingParams(max_tokens=200, **GREEDY)
        )
        many = await collect(
            client,
            "Once upon a time",
            SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, output_kind="delta"),
        )
        return eos[-1].outputs[0], many

    eos, many = run(main())
    assert eos.finish_reason == "stop" and eos.stop_reason in client.config.model_config.eos_token_ids
    assert len(eos.token_ids) < 200
    per_index: dict[int, list[int]] = {}
    for out in many:
        for c in out.outputs:
            per_index.setdefault(c.index, []).extend(c.token_ids)
    assert sorted(per_index) == [0, 1, 2]
    assert all(len(t) == 10 for t in per_index.values())
    assert len({tuple(t) for t in per_index.values()}) > 1  # seeded, but each sample has its own stream


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 2, 10**9], SamplingParams(), "must be in"),
        ([1, -3], SamplingParams(), "must be in"),
        (["a", 1], SamplingParams(), "list of integers"),
        ([1] * 1024, SamplingParams(), "max_model_len"),
        ([1] * 1000, SamplingParams(max_tokens=100), "maximum context length is 1024"),
        ("hello", {"max_tokens": 3}, "SamplingParams"),
        ({"foo": 1}, SamplingParams(), "'prompt' string or 'prompt_token_ids'"),
        (12, SamplingParams(), "prompt must be"),
    ],
)
def test_bad_requests_fail_before_anything_is_sent(client, prompt, params, message):
    async def main():
        with pytest.raises(ValueError, match=message):
            await collect(client, prompt, params)
        assert not client.output_processor.requests

    run(main())


def test_duplicate_request_id_in_flight_is_refused(client):
    async def main():
        first = client.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await collect(client, "Hello", SamplingParams(max_tokens=2), request_id="dup")
        await first.aclose()
        await wait_until_idle(client)
        # Once it is gone, the id can be used again.
        outs = await collect(client, "Hello", SamplingParams(max_tokens=2), request_id="dup")
        assert outs[-1].finished

    run(main())


def test_a_request_the_engine_refuses_fails_alone(client):
    """Validation skipped on purpose: the engine rejects the request and keeps serving."""

    async def main():
        vocab = client.input_processor.vocab_size
        client.input_processor.vocab_size = 10**9
        try:
            with pytest.raises(RequestError, match="must be in"):
                await collect(client, [1, vocab + 5], SamplingParams(max_tokens=4))
        finally:
            client.input_processor.vocab_size = vocab
        outs = await collect(client, "Still alive?", SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(outs[-1].outputs[0].token_ids) == 4
        await client.check_health()

    run(main())


def test_garbage_and_unknown_frames_are_dropped(client):
    """Must hold 5: bad frames on the engine's input socket (and on our output socket) are ignored."""
    endpoint = client._core.output_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    context = zmq.Context.instance()
    pusher = context.socket(zmq.PUSH)
    pusher.setsockopt(zmq.LINGER, 1000)
    pusher.connect(endpoint)

    async def main():
        router = client._core.input_socket
        router.send_multipart([b"0", b"\xff\xfe definitely not msgpack"])
        router.send_multipart([b"0", msgspec.msgpack.encode({"type": "no_such_message", "x": 1})])
        router.send_multipart([b"0", msgspec.msgpack.encode({"type": "request", "req_id": 5})])
        router.send_multipart([b"0", encode(EngineCoreAbort(["nobody"]))])
        pusher.send(b"\x00\x01 garbage for the client")
        pusher.send(msgspec.msgpack.encode({"type": "outputs", "engine_index": "zero"}))
        outs = await collect(client, "Are you still there?", SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(outs[-1].outputs[0].token_ids) == 5
        stats = await client.get_engine_stats()
        assert stats.num_running == 0
        await client.check_health()

    try:
        run(main())
    finally:
        pusher.close()
    assert client._core.output_socket is not None and client.is_running


# ------------------------------------------------------------------------------ must hold 2


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_blocks(client):
    async def main():
        long_params = SamplingParams(max_tokens=400, ignore_eos=True)
        seen = asyncio.Event()

        async def consume_long():
            async for _ in client.generate("A long story:", long_params):
                seen.set()

        victim = asyncio.create_task(consume_long())
        other = asyncio.create_task(
            collect(client, "A short one:", SamplingParams(max_tokens=30, ignore_eos=True))
        )
        await seen.wait()
        stats = await client.get_engine_stats()
        assert stats.num_running >= 1 and stats.kv_cache_usage > 0
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        outs = await other
        assert len(outs[-1].outputs[0].token_ids) == 30
        # 400 tokens would take far longer than this: the engine dropped the request.
        await wait_until_idle(client, timeout=5.0)

        # Breaking out of the iteration aborts as well.
        agen = client.generate("Another long one:", long_params)
        await agen.__anext__()
        await agen.aclose()
        await wait_until_idle(client, timeout=5.0)

        # abort() ends the stream with finish_reason "abort".
        outs = []

        async def consume():
            async for out in client.generate("Abort me:", long_params, request_id="to-abort"):
                outs.append(out)

        task = asyncio.create_task(consume())
        while not outs:
            await asyncio.sleep(0.01)
        await client.abort("to-abort")
        await asyncio.wait_for(task, 5)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await wait_until_idle(client, timeout=5.0)

    run(main())


# ------------------------------------------------------------------------------ must hold 3, 4


def test_sigkill_of_the_engine_fails_every_waiting_request_quickly():
    client = AsyncEngineClient.from_engine_args(EngineArgs(**ENGINE_KWARGS))
    try:

        async def main():
            started = asyncio.Event()
            params = SamplingParams(max_tokens=1000, ignore_eos=True)

            async def consume(i: int):
                async for _ in client.generate(f"Story {i}:", params):
                    started.set()

            tasks = [asyncio.create_task(consume(i)) for i in range(8)]
            await started.wait()
            os.kill(engine_pid(client), signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
            elapsed = time.monotonic() - killed
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert elapsed < 5
            # New requests and health checks fail at once.
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await collect(client, "hello", SamplingParams())
            with pytest.raises(EngineDeadError):
                await client.check_health()
            assert time.monotonic() - t0 < 0.5
            return elapsed

        elapsed = run(main(), timeout=60)
        print(f"engine death noticed by every consumer after {elapsed:.2f} s")
    finally:
        client.shutdown()
    assert client._launcher.processes[0].poll() is not None


OWNER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from vllm_lite import AsyncEngineClient, EngineArgs, SamplingParams
    client = AsyncEngineClient.from_engine_args(EngineArgs(model="smollm2-135m", num_kv_blocks=256))
    async def main():
        print("READY", flush=True)
        async for _ in client.generate("Keep going:", SamplingParams(max_tokens=5000, ignore_eos=True)):
            pass
    asyncio.run(main())
    """
)


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.parametrize("when", ["mid_generation", "during_startup"])
def test_sigkill_of_the_owner_leaves_no_engine_behind(when):
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        engines: list[psutil.Process] = []
        deadline = time.monotonic() + 120
        while not engines and time.monotonic() < deadline:
            engines = _descendants(owner.pid)
            time.sleep(0.05)
        assert engines, "the owner never started an engine"
        if when == "mid_generation":
            assert owner.stdout.readline().strip() == "READY"
            time.sleep(1.0)
        else:
            time.sleep(1.0)  # the engine is importing torch / loading the model
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        killed = time.monotonic()
        gone, alive = psutil.wait_procs(engines, timeout=10)
        assert not alive, f"engine processes outlived their owner: {alive}"
        print(f"engines gone {time.monotonic() - killed:.2f} s after the owner's SIGKILL")
    finally:
        if owner.poll() is None:
            owner.kill()


# ------------------------------------------------------------------------------ startup and shutdown


def _engine_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if "bootstrap" in " ".join(p.cmdline())}


def test_an_engine_that_fails_to_start_gives_a_clear_error():
    before = _engine_children()
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError, match="smaller than one block"):
        AsyncEngineClient.from_engine_args(EngineArgs(model="smollm2-135m", kv_cache_memory=1e-6))
    assert time.monotonic() - t0 < 120
    assert _engine_children() <= before


def test_shutdown_stops_the_engine_and_fails_what_is_in_flight():
    client = AsyncEngineClient.from_engine_args(EngineArgs(**ENGINE_KWARGS))
    pid = engine_pid(client)
    runtime_dir = client._core.runtime_dir

    async def main():
        agen = client.generate("Long:", SamplingParams(max_tokens=1000, ignore_eos=True))
        await agen.__anext__()
        client.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in agen:
                pass
        with pytest.raises(EngineDeadError):
            await client.check_health()

    run(main(), timeout=60)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(runtime_dir)
    client.shutdown()  # idempotent


def test_a_hung_engine_is_declared_dead_after_its_heartbeats_stop():
    """SIGSTOP: the process is alive but silent (as a rank on a lost node would be)."""
    client = AsyncEngineClient.from_engine_args(EngineArgs(**ENGINE_KWARGS), silence_timeout_s=3.0)
    pid = engine_pid(client)
    try:

        async def main():
            agen = client.generate("Long:", SamplingParams(max_tokens=1000, ignore_eos=True))
            await agen.__anext__()
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(EngineDeadError, match="heartbeat"):
                async for _ in agen:
                    pass
            return time.monotonic() - stopped

        elapsed = run(main(), timeout=60)
        assert 2.5 < elapsed < 8, elapsed
    finally:
        os.kill(pid, signal.SIGCONT)
        client.shutdown()
