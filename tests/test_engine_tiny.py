"""Tiny random Llama and Qwen2 checkpoints through the whole engine equal HF greedy generate,
batched, with tiny prefill chunks, under forced preemption and with prefix-cache hits."""

from __future__ import annotations

import random

import pytest

from tests.conftest import hf_greedy
from tests.model_factories import random_hf_model, tiny_llama_config, tiny_qwen2_config
from vllm_lite.engine_core.llm import LLM
from vllm_lite.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.e2e

MAX_NEW = 24
CONFIGS = {
    "llama-gqa": lambda: tiny_llama_config(tie_word_embeddings=False),
    "llama-tied-llama3-rope": lambda: tiny_llama_config(
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-bias": lambda: tiny_qwen2_config(tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(checkpoint dir, prompts, HF greedy reference) for one tiny architecture."""
    hf_model = random_hf_model(CONFIGS[request.param](), seed=1)
    hf_model.generation_config.eos_token_id = None
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory)
    rng = random.Random(0)
    shared = [rng.randrange(3, 320) for _ in range(40)]  # a common prefix: prefix-cache hits
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 70))] for _ in range(6)]
    prompts += [shared + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    reference = hf_greedy(hf_model, prompts, MAX_NEW, [])
    return str(directory), prompts, reference


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 7, "max_num_seqs": 3},
        {"num_kv_blocks": 12, "enable_prefix_caching": False},
    ],
    ids=["batched", "tiny-chunks", "preemption"],
)
def test_equals_hf_greedy(tiny, engine_kwargs):
    directory, prompts, reference = tiny
    llm = LLM(directory, skip_tokenizer_init=True, max_model_len=256, **engine_kwargs)
    assert _generate(llm, prompts) == reference
    stats = llm.engine.get_stats()
    if "num_kv_blocks" in engine_kwargs:
        assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0


def test_prefix_cache_hits_equal_hf(tiny):
    directory, prompts, reference = tiny
    llm = LLM(directory, skip_tokenizer_init=True, max_model_len=256)
    # One at a time: every later prompt with the shared prefix hits the blocks of the first.
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.num_cached_tokens for o in outs[-3:]) >= 3 * 32
    # And all again, batched: prompts now hit their own earlier blocks too.
    assert _generate(llm, prompts) == reference
