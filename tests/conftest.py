"""Shared fixtures: the bundled SmolLM2 model (ours and HF's) and HF greedy references."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_lite.config import ModelSource, resolve_model  # noqa: E402


@pytest.fixture(scope="session")
def smol_source() -> ModelSource:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_hf(smol_source: ModelSource):
    """HF transformers' own model and tokenizer for the bundled GGUF (fp32), the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = smol_source.from_pretrained_kwargs()
    model = AutoModelForCausalLM.from_pretrained(smol_source.directory, dtype=torch.float32, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(smol_source.directory, **kwargs)
    return model, tokenizer


def hf_greedy(
    model, prompts: list[list[int]], max_new_tokens: int, eos_token_ids: list[int]
) -> list[list[int]]:
    """HF greedy `generate`, one prompt at a time (no padding), stopping at EOS like our engine."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_token_ids or None,
                pad_token_id=(eos_token_ids or [0])[0],
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
