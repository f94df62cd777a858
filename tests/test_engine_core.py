"""EngineCore and LLM behaviour on the bundled model: seeded sampling, block accounting, aborts,
n > 1, stop strings and input validation."""

from __future__ import annotations

import time

import pytest

from vllm_lite.engine_core.llm import LLM
from vllm_lite.protocol.messages import EngineCoreRequest, FinishReason
from vllm_lite.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", max_num_batched_tokens=64, num_kv_blocks=256)


def _free_blocks(llm: LLM) -> int:
    return llm.engine.scheduler.kv_cache_manager.num_free_blocks


def test_seeded_request_same_alone_and_in_batch(llm: LLM):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=40)
    prompt = "Tell me a story about a dragon."
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [
        ("The weather today", SamplingParams(temperature=0.8, max_tokens=30)),
        ("List three colors:", SamplingParams(temperature=0.0, max_tokens=20)),
        ("In 1492,", SamplingParams(temperature=1.2, top_k=20, seed=7, max_tokens=50)),
        ("Hello! My name is", SamplingParams(temperature=0.7, min_p=0.1, max_tokens=25)),
    ]
    prompts = [p for p, _ in others[:2]] + [prompt] + [p for p, _ in others[2:]]
    params = [s for _, s in others[:2]] + [seeded] + [s for _, s in others[2:]]
    batched = llm.generate(prompts, params)[2].outputs[0].token_ids
    assert batched == alone
    different = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=40))
    assert different[0].outputs[0].token_ids != alone


def test_finish_and_abort_free_every_block(llm: LLM):
    engine = llm.engine
    start = _free_blocks(llm)
    tokenizer = llm.get_tokenizer()
    long_prompt = tokenizer("word " * 300).input_ids  # several prefill chunks at a 64-token budget
    for i in range(6):
        params = SamplingParams(temperature=0.0, max_tokens=200 if i % 2 else 5, ignore_eos=True)
        engine.add_request(EngineCoreRequest(f"r{i}", long_prompt[: 50 + 40 * i], params, time.monotonic()))
    engine.step()
    engine.step()
    assert _free_blocks(llm) < start
    aborted = engine.abort_requests(["r1", "r5"])  # r5 is still waiting or mid-prefill
    assert {o.req_id for o in aborted} == {"r1", "r5"}
    assert all(o.finish_reason == FinishReason.ABORT for o in aborted)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.req_id] = out.finish_reason
        if "r0" in finished and "r3" in engine.scheduler.requests:
            engine.abort_requests(["r3"])  # mid-decode abort
    assert finished.get("r0") == FinishReason.LENGTH
    assert _free_blocks(llm) == start
    assert engine.get_stats().kv_cache_usage == 0.0


def test_n_samples_and_stop_strings(llm: LLM):
    out = llm.generate(["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    greedy = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    assert " 7" in greedy.text
    stopped = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=30, stop=[" 7"]))[0]
    assert stopped.outputs[0].text == greedy.text[: greedy.text.index(" 7")]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == " 7"


def test_logprobs_and_min_tokens(llm: LLM):
    out = llm.generate(["The sun"], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and lp.rank == 1
        assert lp.top_token_ids[0] == token and len(lp.top_token_ids) == 3
        assert lp.logprob <= 0.0
    eos = llm.engine.eos_token_ids[0]
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0.0, max_tokens=64))
    short = chat[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos
    forced = llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=64, min_tokens=len(short.token_ids) + 5),
    )[0].outputs[0]
    assert eos not in forced.token_ids[: len(short.token_ids) + 5]


def test_invalid_inputs_raise_clear_errors(llm: LLM):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([{"prompt_token_ids": [1, 10**9]}])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1] * 10_000}])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    # The engine still serves afterwards.
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
