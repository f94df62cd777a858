"""OpenAI request bodies -> SamplingParams, and the Prometheus exposition (no server needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vllm_lite.frontend.metrics import Metrics
from vllm_lite.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm_lite.protocol.messages import EngineStats
from vllm_lite.protocol.sampling_params import RequestOutputKind


def test_completion_fields_map_to_sampling_params():
    body = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "n": 2,
            "stop": "\n",
            "seed": -3,
            "logprobs": 3,
            "presence_penalty": 0.5,
            "top_k": 20,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "stream": True,
            "some_future_field": 1,
        }
    )
    p = body.to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed, p.logprobs) == (
        7,
        0.5,
        0.9,
        2,
        ["\n"],
        -3,
        3,
    )
    assert (p.presence_penalty, p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos) == (
        0.5,
        20,
        0.1,
        1.1,
        True,
    )
    assert p.output_kind == RequestOutputKind.DELTA
    assert CompletionRequest(prompt="x").to_sampling_params().output_kind == RequestOutputKind.FINAL_ONLY
    # OpenAI's default temperature is 1, its default max_tokens 16.
    default = CompletionRequest(prompt="x").to_sampling_params()
    assert (default.temperature, default.max_tokens) == (1.0, 16)


@pytest.mark.parametrize(
    "prompt, expected",
    [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_chat_max_completion_tokens_wins_and_logprobs_map():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 4,
        }
    )
    p = body.to_sampling_params()
    assert (p.max_tokens, p.logprobs) == (9, 4)
    assert body.messages[0].to_template_dict() == {"role": "user", "content": "ab"}
    # Chat leaves max_tokens open (until max_model_len) when neither field is given.
    assert ChatCompletionRequest(messages=[]).to_sampling_params().max_tokens is None


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "n": 0}, "n must be"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
        ({"prompt": "x", "suffix": "s"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo with logprobs"),
    ],
)
def test_bad_completion_fields_raise_value_errors_naming_them(body, message):
    with pytest.raises(ValueError, match=message):
        CompletionRequest.model_validate(body).to_sampling_params()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 2}, "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_chat_fields(extra, message):
    with pytest.raises(ValueError, match=message):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], **extra}
        ).to_sampling_params()


def test_image_parts_are_refused():
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    )
    with pytest.raises(ValueError, match="only text content parts"):
        body.messages[0].to_template_dict()


def test_wrong_types_fail_validation():
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": {"a": 1}})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": "hello"})


def test_metrics_exposition():
    m = Metrics("my-model")
    m.update_engine_stats(
        0,
        EngineStats(
            num_running=3,
            num_waiting=1,
            kv_cache_usage=0.25,
            prefix_cache_queries=64,
            prefix_cache_hits=32,
            num_preemptions=0,
        ),
    )
    m.observe_tokens(1, first=True, since_last_s=0.2)
    m.observe_tokens(2, first=False, since_last_s=0.1)
    m.observe_finished(1.5, 0.01, num_prompt_tokens=12, finish_reason="length")
    text = m.render().decode()
    expect = [
        'vllm_lite:num_requests_running{engine="0",model_name="my-model"} 3.0',
        'vllm_lite:num_requests_waiting{engine="0",model_name="my-model"} 1.0',
        'vllm_lite:kv_cache_usage_perc{engine="0",model_name="my-model"} 0.25',
        'vllm_lite:prefix_cache_hits_total{engine="0",model_name="my-model"} 32.0',
        'vllm_lite:generation_tokens_total{model_name="my-model"} 3.0',
        'vllm_lite:prompt_tokens_total{model_name="my-model"} 12.0',
        'vllm_lite:time_to_first_token_seconds_count{model_name="my-model"} 1.0',
        'vllm_lite:inter_token_latency_seconds_count{model_name="my-model"} 2.0',
        'vllm_lite:e2e_request_latency_seconds_sum{model_name="my-model"} 1.5',
        'vllm_lite:request_queue_time_seconds_count{model_name="my-model"} 1.0',
        'vllm_lite:request_success_total{finished_reason="length",model_name="my-model"} 1.0',
    ]
    for line in expect:
        assert line in text, line


def test_text_offsets_count_characters_not_tokens():
    from vllm_lite.frontend.openai.serving import TextOffsets

    offsets = TextOffsets(start=5)
    # "é" split over two tokens, then "a": both halves start at 5, "a" at 6.
    assert [offsets.advance(b) for b in (b"\xc3", b"\xa9", b"a")] == [5, 5, 6]
    assert offsets.offset == 7
