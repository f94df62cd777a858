"""`vllm-lite serve` end to end: the real server process, the real `openai` client, the bundled model.

Server starts are expensive (~15-40 s here), so one server (API key, served name, long context)
serves most tests; the dead-engine tests and the SIGTERM tests each start their own, last.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import threading
import time
from typing import Any

import openai
import psutil
import pytest

from tests.openai_server import OpenAIServer, alive, httpx
from vllm_lite import __version__

pytestmark = pytest.mark.e2e

API_KEY = "test-key-123"
SERVED_NAME = "smol-served"
MAX_MODEL_LEN = 4096
MAIN_ARGS = ["--num-kv-blocks", "2048", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]

COMPLETION_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
CHAT_PROMPTS = ["What is 2 + 2?", "Name three colors."]
GREEDY_TOKENS = 16
IGNORE_EOS = {"ignore_eos": True}


def run(coro, timeout: float):
    """Run a coroutine on a fresh loop with a hard bound: a hang fails the test, not CI."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def offline_refs() -> dict[str, dict[str, str]]:
    """Greedy texts from the offline engine, computed once; the engine is freed afterwards."""
    from vllm_lite import LLM, SamplingParams

    llm = LLM("smollm2-135m", num_kv_blocks=512, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS)
    refs = {
        "completion": {p: llm.generate(p, params)[0].outputs[0].text for p in COMPLETION_PROMPTS},
        "chat": {p: llm.chat(user(p), params)[0].outputs[0].text for p in CHAT_PROMPTS},
    }
    del llm
    gc.collect()
    return refs


@pytest.fixture(scope="module")
def server(offline_refs):  # the offline references first: the two engines do not compete for CPU
    with OpenAIServer(MAIN_ARGS, api_key=API_KEY, served_model_name=SERVED_NAME) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: OpenAIServer):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def http(server: OpenAIServer):
    with server.http() as c:
        yield c


# ------------------------------------------------------------------------------ helpers


def _consume(stream: Any, text_of: Any, logprobs_of: Any) -> dict[str, Any]:
    """Read a stream of chunks, checking its shape: text, finish reason, logprobs and role per
    choice index, the usage chunk (last, without choices), and the chunks themselves."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    logprobs: dict[int, list[Any]] = {}
    roles: dict[int, str] = {}
    usage = None
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            assert usage is None, "two usage chunks"
            assert chunk.choices == [], "the usage chunk carries no choices"
            usage = chunk.usage
        for c in chunk.choices:
            assert usage is None, "a choice after the usage chunk"
            role = getattr(getattr(c, "delta", None), "role", None)
            if role is not None:
                roles[c.index] = role
            texts[c.index] = texts.get(c.index, "") + (text_of(c) or "")
            if c.finish_reason is not None:
                assert finish.get(c.index) is None, "two finish reasons for one choice"
            finish[c.index] = c.finish_reason or finish.get(c.index)
            pieces = logprobs_of(c)
            if pieces:
                logprobs.setdefault(c.index, []).extend(pieces)
    return {
        "texts": texts,
        "finish": finish,
        "usage": usage,
        "chunks": chunks,
        "logprobs": logprobs,
        "roles": roles,
    }


def stream_completion(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """Consume a streamed completion: logprobs are the per-chunk logprobs objects."""
    return _consume(
        client.completions.create(stream=True, **kwargs),
        text_of=lambda c: c.text,
        logprobs_of=lambda c: [c.logprobs] if c.logprobs is not None else [],
    )


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """Consume a streamed chat completion: logprobs are the token entries of `logprobs.content`."""
    return _consume(
        client.chat.completions.create(stream=True, **kwargs),
        text_of=lambda c: c.delta.content,
        logprobs_of=lambda c: c.logprobs.content if c.logprobs is not None and c.logprobs.content else [],
    )


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> (name, labels, value) samples."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"unparsable metrics line: {line!r}"
        samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return samples


def metric(samples: list[tuple[str, dict[str, str], float]], name: str) -> float:
    """The sum of every sample named `name` (across label sets); fails if there is none."""
    values = [v for n, _, v in samples if n == name]
    assert values, f"{name} not in /metrics (have {sorted({n for n, _, _ in samples})})"
    return sum(values)


def get_metrics(server: OpenAIServer) -> list[tuple[str, dict[str, str], float]]:
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return parse_metrics(r.text)


def wait_idle(server: OpenAIServer, timeout: float = 15.0) -> list[tuple[str, dict[str, str], float]]:
    """Poll /metrics until no request runs or waits in any engine and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        samples = get_metrics(server)
        load = {
            name: metric(samples, name)
            for name in (
                "vllm_lite:num_requests_running",
                "vllm_lite:num_requests_waiting",
                "vllm_lite:kv_cache_usage_perc",
            )
        }
        if all(v == 0 for v in load.values()):
            return samples
        assert time.monotonic() < deadline, f"server still busy after {timeout} s: {load}"
        time.sleep(0.25)


def assert_error_body(response: Any, status: int | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}; returns the inner dict."""
    if status is not None:
        assert response.status_code == status, (response.status_code, response.text)
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error


def normal_completion(client: openai.OpenAI, model: str, max_tokens: int = 4) -> None:
    """One small request that must succeed (the server is still healthy)."""
    r = client.completions.create(
        model=model, prompt="Hello, my name is", max_tokens=max_tokens, temperature=0, extra_body=IGNORE_EOS
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == max_tokens


# ------------------------------------------------------------------------------ basics


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
    assert models.data[0].object == "model"


def test_version(http):
    r = http.get("/version")
    assert r.status_code == 200
    assert r.json()["version"] == __version__ and __version__


def test_health_needs_no_api_key(server):
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


# ------------------------------------------------------------------------------ greedy = offline


@pytest.mark.parametrize("prompt", COMPLETION_PROMPTS)
def test_completion_greedy_equals_offline_engine(client, offline_refs, prompt):
    expected = offline_refs["completion"][prompt]
    kwargs = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0}
    r = client.completions.create(**kwargs)
    assert r.object == "text_completion" and r.model == SERVED_NAME
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == expected
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    s = stream_completion(client, **kwargs)
    assert s["texts"] == {0: expected}
    assert s["usage"] is None  # no include_usage, no usage chunk
    assert s["finish"][0] == r.choices[0].finish_reason


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_chat_greedy_equals_offline_engine(client, offline_refs, prompt):
    expected = offline_refs["chat"][prompt]
    kwargs = {"model": SERVED_NAME, "messages": user(prompt), "temperature": 0}
    r = client.chat.completions.create(max_completion_tokens=GREEDY_TOKENS, **kwargs)
    assert r.object == "chat.completion" and r.model == SERVED_NAME
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    s = stream_chat(client, max_tokens=GREEDY_TOKENS, **kwargs)
    assert s["texts"] == {0: expected}
    assert s["roles"] == {0: "assistant"}
    assert s["finish"][0] == r.choices[0].finish_reason


# ------------------------------------------------------------------------------ usage


def test_completion_stream_include_usage(client):
    kwargs = {"model": SERVED_NAME, "prompt": "Count with me: one, two,", "max_tokens": 7, "temperature": 0}
    full = client.completions.create(extra_body=IGNORE_EOS, **kwargs)
    s = stream_completion(client, stream_options={"include_usage": True}, extra_body=IGNORE_EOS, **kwargs)
    assert s["chunks"][-1].usage is not None, "usage must be the last chunk"
    usage = s["usage"]
    assert usage.prompt_tokens == full.usage.prompt_tokens > 0
    assert usage.completion_tokens == full.usage.completion_tokens == 7
    assert usage.total_tokens == usage.prompt_tokens + 7
    assert s["texts"] == {0: full.choices[0].text}
    assert s["finish"] == {0: "length"}
    assert all(c.usage is None for c in s["chunks"][:-1])


def test_chat_stream_include_usage(client):
    kwargs = {"model": SERVED_NAME, "messages": user("Tell me a joke."), "max_tokens": 6, "temperature": 0}
    full = client.chat.completions.create(extra_body=IGNORE_EOS, **kwargs)
    s = stream_chat(client, stream_options={"include_usage": True}, extra_body=IGNORE_EOS, **kwargs)
    assert s["chunks"][-1].usage is not None, "usage must be the last chunk"
    usage = s["usage"]
    assert usage.prompt_tokens == full.usage.prompt_tokens > 0
    assert usage.completion_tokens == full.usage.completion_tokens == 6
    assert usage.total_tokens == usage.prompt_tokens + 6
    assert s["texts"] == {0: full.choices[0].message.content}
    assert s["finish"] == {0: "length"}


# ------------------------------------------------------------------------------ logprobs


def _check_completion_logprobs(lp: Any, text: str, num_tokens: int, k: int) -> None:
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == num_tokens
    assert "".join(lp.tokens) == text
    offset = 0
    for token, logprob, top, text_offset in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True
    ):
        assert text_offset == offset
        offset += len(token)
        assert logprob <= 0
        assert 1 <= len(top) <= k + 1 and token in top
        # Greedy: the sampled token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)
        assert all(v <= 0 for v in top.values())


def test_completion_logprobs(client):
    kwargs = {"model": SERVED_NAME, "prompt": "The sky is", "max_tokens": 6, "temperature": 0, "logprobs": 3}
    r = client.completions.create(extra_body=IGNORE_EOS, **kwargs)
    choice = r.choices[0]
    _check_completion_logprobs(choice.logprobs, choice.text, 6, 3)
    # Streamed: the pieces add up to the same logprobs, offsets counted across chunks.
    s = stream_completion(client, extra_body=IGNORE_EOS, **kwargs)
    pieces = s["logprobs"][0]
    assert [t for p in pieces for t in p.tokens] == choice.logprobs.tokens
    assert [o for p in pieces for o in p.text_offset] == choice.logprobs.text_offset
    # (fp32 noise: the second request may reuse cached prefix blocks, computed in another batch shape)
    assert [x for p in pieces for x in p.token_logprobs] == pytest.approx(
        choice.logprobs.token_logprobs, abs=1e-3
    )
    # Without logprobs there are none.
    plain = client.completions.create(model=SERVED_NAME, prompt="The sky is", max_tokens=2)
    assert plain.choices[0].logprobs is None


def _check_chat_logprobs(content: list[Any], text: str, num_tokens: int, k: int) -> None:
    assert len(content) == num_tokens
    assert "".join(e.token for e in content) == text
    for e in content:
        assert e.logprob <= 0
        # bytes are the token's own UTF-8 bytes: its text re-encoded unless it holds part of a character
        assert e.bytes == list(e.token.encode()) or "\ufffd" in e.token
        assert len(e.top_logprobs) == k
        top = [t.logprob for t in e.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert top[0] == pytest.approx(e.logprob, abs=1e-4)  # greedy: the most likely token
        assert all(t.bytes == list(t.token.encode()) or "\ufffd" in t.token for t in e.top_logprobs)


def test_chat_logprobs(client):
    kwargs = {
        "model": SERVED_NAME,
        "messages": user("Say hello."),
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = client.chat.completions.create(extra_body=IGNORE_EOS, **kwargs)
    choice = r.choices[0]
    _check_chat_logprobs(choice.logprobs.content, choice.message.content, 5, 3)
    s = stream_chat(client, extra_body=IGNORE_EOS, **kwargs)
    streamed = s["logprobs"][0]
    assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx(
        [e.logprob for e in choice.logprobs.content], abs=1e-3
    )
    # logprobs without top alternatives.
    r0 = client.chat.completions.create(
        model=SERVED_NAME, messages=user("Say hello."), max_tokens=3, temperature=0, logprobs=True
    )
    assert all(e.top_logprobs == [] for e in r0.choices[0].logprobs.content)
    assert len(r0.choices[0].logprobs.content) == r0.usage.completion_tokens


def test_chat_logprobs_bytes_rebuild_multibyte_text(client):
    """OpenAI's `bytes`: the token's UTF-8 bytes, so that characters split over several tokens
    (emoji, CJK) can be put back together; joined over the tokens they give the text."""
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=user("Réponds en japonais: こんにちは 👍 写一句中文"),
        max_tokens=30,
        temperature=0,
        logprobs=True,
        extra_body=IGNORE_EOS,
    )
    text = r.choices[0].message.content
    content = r.choices[0].logprobs.content
    assert any(ord(ch) > 127 for ch in text), f"no multi-byte character in {text!r}: test not meaningful"
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", errors="replace") == text, (joined, text, [e.token for e in content])


# ------------------------------------------------------------------------------ stop strings


def _stop_from(reference: str) -> tuple[str, str]:
    """A stop string taken from the middle of `reference`, and the text expected before it."""
    words = reference.split()
    assert len(words) >= 4, f"reference too short to pick a stop string: {reference!r}"
    stop = words[2]
    return stop, reference[: reference.index(stop)]


def test_completion_stop_string(client):
    kwargs = {"model": SERVED_NAME, "prompt": "The days of the week are Monday,", "temperature": 0}
    reference = client.completions.create(max_tokens=24, extra_body=IGNORE_EOS, **kwargs).choices[0].text
    stop, expected = _stop_from(reference)
    r = client.completions.create(max_tokens=24, stop=[stop], **kwargs)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text
    s = stream_completion(client, max_tokens=24, stop=stop, **kwargs)
    assert s["texts"] == {0: expected}
    assert s["finish"] == {0: "stop"}


def test_chat_stop_string(client):
    kwargs = {
        "model": SERVED_NAME,
        "messages": user("Describe the ocean in two sentences."),
        "temperature": 0,
    }
    reference = client.chat.completions.create(max_tokens=24, extra_body=IGNORE_EOS, **kwargs)
    stop, expected = _stop_from(reference.choices[0].message.content)
    r = client.chat.completions.create(max_tokens=24, stop=[stop], **kwargs)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    s = stream_chat(client, max_tokens=24, stop=[stop], **kwargs)
    assert s["texts"] == {0: expected}
    assert s["finish"] == {0: "stop"}


# ------------------------------------------------------------------------------ n, seeds, echo


def test_n2_completions_and_chat(client):
    common = {"model": SERVED_NAME, "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 5}
    r = client.completions.create(prompt="My favourite animal is", extra_body=IGNORE_EOS, **common)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 10
    s = stream_completion(
        client,
        prompt="My favourite animal is",
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
        **common,
    )
    assert sorted(s["texts"]) == [0, 1]
    assert s["finish"] == {0: "length", 1: "length"}
    assert s["usage"].completion_tokens == 10
    assert s["usage"].prompt_tokens == r.usage.prompt_tokens

    chat = client.chat.completions.create(messages=user("Pick a number."), extra_body=IGNORE_EOS, **common)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 10
    cs = stream_chat(
        client,
        messages=user("Pick a number."),
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
        **common,
    )
    assert sorted(cs["texts"]) == [0, 1]
    assert cs["roles"] == {0: "assistant", 1: "assistant"}
    assert cs["finish"] == {0: "length", 1: "length"}
    assert cs["usage"].completion_tokens == 10


def test_seeded_sampling_is_reproducible(client):
    def completion(seed: int) -> str:
        r = client.completions.create(
            model=SERVED_NAME,
            prompt="In the year 3000, people will",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body=IGNORE_EOS,
        )
        return r.choices[0].text

    def chat(seed: int) -> str:
        r = client.chat.completions.create(
            model=SERVED_NAME,
            messages=user("Invent a name for a cat."),
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body=IGNORE_EOS,
        )
        return r.choices[0].message.content

    for sample in (completion, chat):
        first = sample(1234)
        assert sample(1234) == first, f"{sample.__name__}: same seed, different text"
        others = {sample(seed) for seed in (1, 2, 3)}
        assert others != {first}, f"{sample.__name__}: every seed gave {first!r}"
    # The streamed text of a seeded request is the same as the non-streamed one.
    s = stream_completion(
        client,
        model=SERVED_NAME,
        prompt="In the year 3000, people will",
        max_tokens=12,
        temperature=1.0,
        seed=1234,
        extra_body=IGNORE_EOS,
    )
    assert s["texts"] == {0: completion(1234)}


def test_completion_echo(client):
    prompt = "Roses are red,"
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text


# ------------------------------------------------------------------------------ metrics


def test_metrics_counters_increase_after_a_request(client, server):
    before = wait_idle(server)
    names = {n for n, _, _ in before}
    for name in (
        "vllm_lite:num_requests_running",
        "vllm_lite:num_requests_waiting",
        "vllm_lite:kv_cache_usage_perc",
        "vllm_lite:prompt_tokens_total",
        "vllm_lite:generation_tokens_total",
        "vllm_lite:prefix_cache_queries_total",
        "vllm_lite:prefix_cache_hits_total",
    ):
        assert name in names, name
    for hist in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time"):
        for suffix in ("_bucket", "_sum", "_count"):
            assert f"vllm_lite:{hist}_seconds{suffix}" in names, hist + suffix
    running = [labels for n, labels, _ in before if n == "vllm_lite:num_requests_running"]
    assert running and all(labels.get("model_name") == SERVED_NAME for labels in running), running

    r = client.completions.create(
        model=SERVED_NAME, prompt="Metrics are", max_tokens=5, temperature=0, extra_body=IGNORE_EOS
    )
    after = get_metrics(server)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("vllm_lite:generation_tokens_total") == 5
    assert delta("vllm_lite:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm_lite:e2e_request_latency_seconds_count") == 1
    assert delta("vllm_lite:time_to_first_token_seconds_count") == 1
    assert delta("vllm_lite:prefix_cache_queries_total") > 0


# ------------------------------------------------------------------------------ errors: 400


def _chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": user("Hi"), "max_tokens": 4, **extra}


def _completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 4, **extra}


BAD_REQUESTS = {
    "completion-temperature-negative": ("/v1/completions", _completion_body(temperature=-1)),
    "chat-temperature-negative": ("/v1/chat/completions", _chat_body(temperature=-1)),
    "completion-top_p-2": ("/v1/completions", _completion_body(top_p=2)),
    "chat-top_p-2": ("/v1/chat/completions", _chat_body(top_p=2)),
    "completion-n-0": ("/v1/completions", _completion_body(n=0)),
    "chat-n-0": ("/v1/chat/completions", _chat_body(n=0)),
    "completion-max_tokens-0": ("/v1/completions", _completion_body(max_tokens=0)),
    "chat-max_tokens-0": ("/v1/chat/completions", _chat_body(max_tokens=0)),
    "chat-max_completion_tokens-0": ("/v1/chat/completions", _chat_body(max_completion_tokens=0)),
    "completion-max_tokens-not-int": ("/v1/completions", _completion_body(max_tokens="many")),
    "completion-logprobs-50": ("/v1/completions", _completion_body(logprobs=50)),
    "completion-logprobs-true": ("/v1/completions", _completion_body(logprobs=True)),
    "completion-stream-yes": ("/v1/completions", _completion_body(stream="yes")),
    "completion-max_tokens-true": ("/v1/completions", _completion_body(max_tokens=True)),
    "completion-temperature-string": ("/v1/completions", _completion_body(temperature="0.5")),
    "chat-ignore_eos-yes": ("/v1/chat/completions", _chat_body(ignore_eos="yes")),
    "completion-n-too-many": ("/v1/completions", _completion_body(n=100000)),
    "chat-top_logprobs-50": ("/v1/chat/completions", _chat_body(logprobs=True, top_logprobs=50)),
    "chat-response_format-json_object": (
        "/v1/chat/completions",
        _chat_body(response_format={"type": "json_object"}),
    ),
    "chat-tools": (
        "/v1/chat/completions",
        _chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ),
    "completion-logit_bias": ("/v1/completions", _completion_body(logit_bias={"50256": -100})),
    "chat-logit_bias": ("/v1/chat/completions", _chat_body(logit_bias={"50256": -100})),
    "completion-presence_penalty-3": ("/v1/completions", _completion_body(presence_penalty=3)),
    "completion-stream-temperature-negative": (
        "/v1/completions",
        _completion_body(temperature=-1, stream=True),
    ),
    "chat-stream-top_p-2": ("/v1/chat/completions", _chat_body(top_p=2, stream=True)),
    # Too long: prompt + max_tokens beyond max_model_len, or the prompt alone.
    "completion-too-long-with-max_tokens": (
        "/v1/completions",
        _completion_body(prompt="Hello there " * 10, max_tokens=MAX_MODEL_LEN),
    ),
    "completion-prompt-too-long": (
        "/v1/completions",
        _completion_body(prompt="hello " * (MAX_MODEL_LEN + 100), max_tokens=1),
    ),
    "chat-too-long-with-max_tokens": ("/v1/chat/completions", _chat_body(max_tokens=MAX_MODEL_LEN)),
    "completion-stream-too-long": (
        "/v1/completions",
        _completion_body(max_tokens=MAX_MODEL_LEN, stream=True),
    ),
    # Empty prompts.
    "completion-empty-string": ("/v1/completions", _completion_body(prompt="")),
    "completion-empty-list": ("/v1/completions", _completion_body(prompt=[])),
    "completion-empty-token-list": ("/v1/completions", _completion_body(prompt=[[]])),
    "completion-list-with-empty-string": ("/v1/completions", _completion_body(prompt=[""])),
    "chat-no-messages": ("/v1/chat/completions", _chat_body(messages=[])),
}


@pytest.mark.parametrize("path, body", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_400(http, path, body):
    r = http.post(path, json=body)
    error = assert_error_body(r, 400)
    assert error["type"] == "invalid_request_error"


def test_request_length_limit_is_exact(client, server):
    """prompt + max_tokens == max_model_len is accepted; one token more is a 400."""
    prompt = "Hello there, how are you today?"
    num_prompt = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=1).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_MODEL_LEN - num_prompt + 1)
    # At the limit: accepted (streamed, and dropped after the first chunk; the server aborts it).
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - num_prompt, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        assert _read_sse(response.iter_lines(), count=1)
    wait_idle(server)


def test_bad_request_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=4, temperature=-1)
    assert info.value.status_code == 400
    assert "temperature" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=SERVED_NAME, messages=user("Hi"), max_tokens=MAX_MODEL_LEN, stream=True
        )
    assert info.value.status_code == 400
    assert str(MAX_MODEL_LEN) in info.value.body["message"]


MALFORMED_BODIES = {
    "not-json": b"{this is not json",
    "truncated-json": b'{"prompt": "Hi", "max_tokens": ',
    "json-array": b'[{"prompt": "Hi"}]',
    "json-string": b'"Hi"',
    "json-number": b"42",
    "json-null": b"null",
    "empty-body": b"",
    "missing-prompt": json.dumps({"model": SERVED_NAME, "max_tokens": 4}).encode(),
    "prompt-wrong-type": json.dumps({"model": SERVED_NAME, "prompt": {"text": "Hi"}}).encode(),
}


MALFORMED_CHAT_BODIES = {
    "not-json": b"{not json",
    "json-array": b"[]",
    "json-string": b'"Hi"',
    "missing-messages": json.dumps({"model": SERVED_NAME, "max_tokens": 4}).encode(),
    "messages-not-a-list": json.dumps({"model": SERVED_NAME, "messages": "Hi"}).encode(),
    "message-no-role": json.dumps({"model": SERVED_NAME, "messages": [{"content": "no role"}]}).encode(),
}
MALFORMED = {
    **{f"completion-{k}": ("/v1/completions", v) for k, v in MALFORMED_BODIES.items()},
    **{f"chat-{k}": ("/v1/chat/completions", v) for k, v in MALFORMED_CHAT_BODIES.items()},
}


@pytest.mark.parametrize("path, body", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_body_is_4xx(http, path, body):
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert_error_body(r)


# ------------------------------------------------------------------------------ errors: 401, 404


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", _completion_body()),
        ("POST", "/v1/chat/completions", _chat_body()),
    ],
    ids=["models", "completions", "chat"],
)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}], ids=["no-key", "wrong-key"])
def test_api_key_required_on_v1(server, method, path, body, headers):
    r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)
    error = assert_error_body(r, 401)
    assert error["type"] == "authentication_error"


def test_wrong_api_key_through_the_openai_client(server):
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", _completion_body(model="no-such-model")),
        ("/v1/chat/completions", _chat_body(model="no-such-model")),
        ("/v1/completions", _completion_body(model="no-such-model", stream=True)),
    ],
    ids=["completions", "chat", "completions-stream"],
)
def test_unknown_model_is_404(http, path, body):
    assert_error_body(http.post(path, json=body), 404)


def test_unknown_model_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=user("Hi"), max_tokens=2)
    assert info.value.status_code == 404


def test_server_still_answers_after_the_errors(client, server):
    normal_completion(client, SERVED_NAME)
    r = client.chat.completions.create(model=SERVED_NAME, messages=user("Hi"), max_tokens=3)
    assert r.choices[0].message.content is not None
    wait_idle(server)


# ------------------------------------------------------------------------------ load and disconnects


@pytest.mark.timeout(600)
def test_200_concurrent_streams_all_finish_with_exact_length(server):
    num_requests, max_tokens = 200, 8

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str | None, Any, int]:
        common = {
            "model": SERVED_NAME,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "extra_body": IGNORE_EOS,
        }
        if i % 2:
            stream = await c.chat.completions.create(messages=user(f"Request {i}: say something."), **common)
        else:
            stream = await c.completions.create(prompt=f"Request {i}: the number {i * 7} is", **common)
        finish, usage, pieces = None, None, 0
        async with stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    pieces += 1
        return finish, usage, pieces

    async def main():
        async with server.async_client(timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(num_requests)))

    results = run(main(), timeout=420)
    assert len(results) == num_requests
    for i, (finish, usage, pieces) in enumerate(results):
        assert finish == "length", (i, finish)
        assert usage is not None and usage.completion_tokens == max_tokens, (i, usage)
        assert pieces >= 1
    wait_idle(server)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnected_clients_free_the_engine(server, client, stream):
    num_requests, timeout_s = 50, 0.5

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        try:
            # The client's timeout bounds each read; a stream sends often, so bound the whole call too.
            async with asyncio.timeout(timeout_s):
                kwargs = {
                    "model": SERVED_NAME,
                    "prompt": f"Request {i}: write a very long story about dragons.",
                    "max_tokens": 2000,
                    "extra_body": IGNORE_EOS,
                }
                if stream:
                    s = await c.completions.create(stream=True, **kwargs)
                    async with s:
                        async for _ in s:
                            pass
                else:
                    await c.completions.create(**kwargs)
            return "completed"
        except (TimeoutError, openai.APITimeoutError):
            return "timed out"

    async def main():
        async with server.async_client(timeout=timeout_s) as c:
            return await asyncio.gather(*(one(c, i) for i in range(num_requests)))

    outcomes = run(main(), timeout=120)
    assert outcomes == ["timed out"] * num_requests
    wait_idle(server, timeout=20)
    # The engine is free for new work.
    normal_completion(client, SERVED_NAME)
    wait_idle(server)


# ------------------------------------------------------------------------------ dead engines (own server)


def _kill_engines(server: OpenAIServer) -> list[int]:
    engines = server.engine_processes()
    for p in engines:
        p.kill()
    psutil.wait_procs(engines, timeout=10)
    return [p.pid for p in engines]


def _read_sse(lines: Any, count: int | None = None) -> list[str]:
    """`data:` payloads from an SSE line iterator (all of them, or the first `count`)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(line[len("data: ") :])
            if count is not None and len(events) >= count:
                break
    return events


@pytest.fixture(scope="module")
def dying_server():
    with OpenAIServer(["--num-kv-blocks", "256", "--max-model-len", "2048"]) as s:
        yield s


@pytest.mark.timeout(300)
def test_stream_error_after_first_chunk_is_an_error_event_then_done(dying_server):
    server = dying_server
    assert server.engine_processes(), "no engine child found"
    bodies = {
        "/v1/completions": {"prompt": "Count to one thousand:", "max_tokens": 1500},
        "/v1/chat/completions": {"messages": user("Count to one thousand."), "max_tokens": 1500},
    }
    with contextlib.ExitStack() as stack:
        streams = {}
        for path, body in bodies.items():
            c = stack.enter_context(httpx.Client(base_url=server.url, timeout=60))
            response = stack.enter_context(
                c.stream("POST", path, json={**body, "stream": True, "ignore_eos": True, "temperature": 0})
            )
            assert response.status_code == 200
            lines = response.iter_lines()
            first = _read_sse(lines, count=3)  # a few chunks: the stream is under way
            assert len(first) == 3 and all("error" not in json.loads(e) for e in first), first
            streams[path] = lines
        assert _kill_engines(server)
        for path, lines in streams.items():
            rest = _read_sse(lines)  # bounded by the client's read timeout
            assert rest[-1] == "[DONE]", (path, rest[-3:])
            assert rest.count("[DONE]") == 1
            error = json.loads(rest[-2])
            assert set(error) == {"error"}, (path, error)
            assert set(error["error"]) >= {"message", "type", "param", "code"}, error
            assert error["error"]["message"], error
            for event in rest[:-2]:  # whatever came before the error are ordinary chunks
                assert "error" not in json.loads(event), (path, event)


@pytest.mark.timeout(300)
def test_dead_engine_gives_503(dying_server):
    server = dying_server
    _kill_engines(server)  # no-op when the previous test already did
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{server.url}/health", timeout=30)).status_code != 503:
        assert r.status_code == 200, (r.status_code, r.text)
        assert time.monotonic() < deadline, "/health never turned 503 after the engine was killed"
        time.sleep(0.25)
    with server.http() as http:
        for path, body in [
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": True}),
            ("/v1/chat/completions", {"messages": user("Hi"), "max_tokens": 4}),
            ("/v1/chat/completions", {"messages": user("Hi"), "max_tokens": 4, "stream": True}),
        ]:
            assert_error_body(http.post(path, json=body), 503)
        assert http.get("/metrics").status_code == 200  # the server itself still answers
    with pytest.raises(openai.InternalServerError) as info:
        server.client().completions.create(model=server.model, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 503


# ------------------------------------------------------------------------------ SIGTERM (own servers)


def _assert_all_gone(procs: list[psutil.Process], server: OpenAIServer) -> None:
    _, still = psutil.wait_procs([p for p in procs if alive(p)], timeout=15)
    still = [p for p in still if alive(p)]
    assert not still, f"left behind: {[(p.pid, p.cmdline()) for p in still]}\n{server.output()}"


@pytest.mark.timeout(300)
def test_sigterm_leaves_no_process_behind():
    with OpenAIServer(["--num-kv-blocks", "128", "--max-model-len", "1024"]) as server:
        normal_completion(server.client(), server.model)
        procs = server.known_processes()
        assert server.engine_processes(), "no engine child found"
        code = server.terminate(timeout=60)
        assert code == 0, f"exit code {code}\n{server.output()}"
        _assert_all_gone(procs, server)
        assert "Traceback" not in server.output(), server.output()


@pytest.mark.timeout(300)
def test_sigterm_with_a_stream_in_flight_ends_it_and_leaves_no_process_behind():
    shutdown_timeout = 2.0
    args = ["--num-kv-blocks", "512", "--max-model-len", "4096", "--shutdown-timeout", str(shutdown_timeout)]
    with OpenAIServer(args) as server:
        procs = server.known_processes()
        assert server.engine_processes(), "no engine child found"
        started = threading.Event()
        result: dict[str, Any] = {}

        def consume() -> None:
            events: list[str] = []
            try:
                with httpx.Client(base_url=server.url, timeout=60) as c:
                    body = {
                        "prompt": "Write a long essay.",
                        "max_tokens": 3000,
                        "ignore_eos": True,
                        "stream": True,
                    }
                    with c.stream("POST", "/v1/completions", json=body) as response:
                        result["status"] = response.status_code
                        for line in response.iter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                                started.set()
                result["end"] = "closed"
            except httpx.HTTPError as exc:  # the server cut the stream: that is an end too
                result["end"] = type(exc).__name__
            finally:
                result["events"] = events
                started.set()

        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        assert started.wait(120), "the stream never started"
        assert result.get("status") == 200
        t0 = time.monotonic()
        code = server.terminate(timeout=60)
        elapsed = time.monotonic() - t0
        thread.join(timeout=30)
        assert not thread.is_alive(), "the in-flight stream still hangs after the server exited"
        assert code == 0, f"exit code {code}\n{server.output()}"
        assert elapsed < shutdown_timeout + 30, f"shutdown took {elapsed:.1f} s"
        assert "end" in result and result["events"], result
        _assert_all_gone(procs, server)
