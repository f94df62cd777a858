"""SamplingParams: vLLM defaults, validation on construction and on decode, n>1 fan-out seeds."""

from __future__ import annotations

import math

import msgspec
import pytest

from vllm_lite.protocol.sampling_params import SamplingParams


def test_defaults_are_vllms() -> None:
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (sp.seed, sp.max_tokens, sp.min_tokens, sp.logprobs) == (None, 16, 0, None)
    assert (sp.stop, sp.stop_token_ids) == ([], [])
    assert not sp.include_stop_str_in_output and not sp.ignore_eos and sp.skip_special_tokens
    assert not sp.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens=16
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_invalid_values_raise_naming_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be") as info:
        SamplingParams(**kwargs)
    assert "got" in str(info.value)  # the message shows the offending value


def test_message_names_the_allowed_range() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0 and finite; got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=2.0)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=50)


def test_edge_values_are_accepted_and_normalized() -> None:
    sp = SamplingParams(
        temperature=0, top_p=1, top_k=-1, min_p=1, repetition_penalty=2, presence_penalty=-2, seed=-5
    )
    assert sp.top_k == 0  # -1 means disabled, stored as 0
    assert type(sp.temperature) is float and type(sp.top_p) is float and type(sp.repetition_penalty) is float
    assert sp.is_greedy and sp.seed == -5
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3
    assert SamplingParams(seed=2**63 - 1, logprobs=20).logprobs == 20
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(stop="\n").stop == ["\n"]  # a lone string is shorthand for a list


def test_is_greedy_threshold_matches_vllm() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_frozen() -> None:
    sp = SamplingParams()
    with pytest.raises(AttributeError):
        sp.temperature = 0.5  # type: ignore[misc]


def test_msgpack_roundtrip() -> None:
    sp = SamplingParams(
        n=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=-12,
        max_tokens=None,
        min_tokens=2,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 9],
        include_stop_str_in_output=True,
        ignore_eos=True,
        logprobs=5,
        skip_special_tokens=False,
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert decoded == sp
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams()), type=SamplingParams) == (
        SamplingParams()
    )


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 99}, "logprobs"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"stop_token_ids": [-4]}, "stop_token_ids"),
    ],
)
def test_decoding_invalid_values_raises(fields: dict, name: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=name):
        msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=SamplingParams)


def test_decoding_normalizes_and_rejects_unknown_fields_and_types() -> None:
    sp = msgspec.msgpack.decode(msgspec.msgpack.encode({"top_k": -1, "temperature": 1}), type=SamplingParams)
    assert sp.top_k == 0 and type(sp.temperature) is float
    with pytest.raises(msgspec.ValidationError, match="tempreature"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"tempreature": 0.5}), type=SamplingParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"ignore_eos": 1}), type=SamplingParams)


def test_clone_for_sample() -> None:
    parent = SamplingParams(n=4, seed=1234, temperature=0.8, top_p=0.9, stop=["x"])
    children = [parent.clone_for_sample(i) for i in range(4)]
    assert all(c.n == 1 for c in children)
    assert children[0].seed == 1234  # the first sample agrees with an n=1 request
    seeds = [c.seed for c in children]
    assert len(set(seeds)) == 4
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    assert [parent.clone_for_sample(i).seed for i in range(4)] == seeds  # deterministic
    other = SamplingParams(n=4, seed=1235).clone_for_sample(1).seed
    assert other != seeds[1]  # the child seed depends on the parent seed, not only on the index
    assert msgspec.structs.replace(children[2], seed=1234, n=4) == parent  # nothing else changed
    unseeded = SamplingParams(n=2).clone_for_sample(1)
    assert unseeded.seed is None and unseeded.n == 1
    # A negative parent seed still gives valid child seeds.
    assert 0 <= SamplingParams(n=2, seed=-1).clone_for_sample(1).seed < 2**63


@pytest.mark.parametrize("index", [-1, 4, True])
def test_clone_for_sample_rejects_bad_index(index: int) -> None:
    with pytest.raises(ValueError, match="index"):
        SamplingParams(n=4, seed=1).clone_for_sample(index)
