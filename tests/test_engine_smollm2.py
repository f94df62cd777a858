"""The bundled SmolLM2 through our engine equals HF transformers' greedy generate, token for token,
alone and batched, with tiny prefill chunks, under forced preemption and with prefix-cache hits."""

from __future__ import annotations

import pytest

from tests.conftest import hf_greedy
from vllm_lite.engine_core.llm import LLM
from vllm_lite.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.e2e

MAX_NEW = 64
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: I like apples and oranges.",
    "The three laws of thermodynamics are",
    "Écrivez une phrase sur la mer:",
    "SELECT name, age FROM users WHERE",
    "A haiku about autumn leaves:\n",
    "Q: What is 17 times 3?\nA:",
]
CHATS = [
    "What is the tallest mountain in the world?",
    "Write a short poem about a cat.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def prompts(smol_hf) -> list[list[int]]:
    _, tokenizer = smol_hf
    plain = [tokenizer(t).input_ids for t in TEXTS]
    chats = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for c in CHATS
    ]
    return plain + chats


@pytest.fixture(scope="module")
def reference(smol_hf, prompts) -> list[list[int]]:
    model, _ = smol_hf
    return hf_greedy(model, prompts, MAX_NEW, [model.config.eos_token_id])


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def test_batched_equals_hf(prompts, reference):
    llm = LLM("smollm2-135m")
    assert len(prompts) >= 16
    assert _tokens(llm, prompts) == reference
    # Alone, one at a time: the same tokens again.
    for p, ref in zip(prompts[:3], reference[:3], strict=True):
        assert _tokens(llm, [p]) == [ref]
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_small_chunks_and_prefix_hits_equal_hf(prompts, reference):
    llm = LLM("smollm2-135m", max_num_batched_tokens=24, max_num_seqs=8)
    assert _tokens(llm, prompts) == reference
    before = llm.engine.get_stats().prefix_cache_hits
    # Same prompts again: their full blocks now come from the prefix cache.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.get_stats().prefix_cache_hits > before
    assert any(o.num_cached_tokens > 0 for o in outs)


def test_preemption_equals_hf(prompts, reference):
    # 16 blocks of 16 tokens cannot hold 16 requests of ~30-60 + 64 tokens at once.
    llm = LLM("smollm2-135m", num_kv_blocks=24, enable_prefix_caching=False)
    assert _tokens(llm, prompts) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert llm.engine.scheduler.kv_cache_manager.num_free_blocks == 24
