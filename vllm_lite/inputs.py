"""Prompts as users give them, turned into validated token ids.

Shared by the offline `LLM` (engine_core) and the `AsyncEngineClient` (frontend), and the engine
core re-checks token ids with `validate_prompt_token_ids` since its socket may be reached directly.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from vllm_lite.tokenizer import apply_chat_template

# A prompt: text, token ids, chat messages ([{"role": ..., "content": ...}, ...]), or a dict
# {"prompt": "..."} / {"prompt_token_ids": [...]}.
PromptType = str | Sequence[int] | Sequence[dict[str, Any]] | dict[str, Any]


def is_chat(prompt: object) -> bool:
    """True for a list of chat messages (dicts with a 'role')."""
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m for m in prompt)
    )


def prompt_text(prompt: PromptType) -> str | None:
    """The prompt's text when it was given as text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def tokenize_prompt(tokenizer: Any, prompt: PromptType, chat_template: str | None = None) -> list[int]:
    """Token ids of any accepted prompt form; raises ValueError on a malformed prompt."""
    needs_tokenizer = (
        isinstance(prompt, str) or is_chat(prompt) or (isinstance(prompt, dict) and "prompt" in prompt)
    )
    if needs_tokenizer and tokenizer is None:
        raise ValueError(
            "text and chat prompts need a tokenizer; this engine was made with skip_tokenizer_init"
        )
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    if is_chat(prompt):
        return apply_chat_template(tokenizer, list(prompt), chat_template)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return _token_list(prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return list(tokenizer(prompt["prompt"]).input_ids)
        raise ValueError("a dict prompt needs a 'prompt' string or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)):
        return _token_list(prompt)
    raise ValueError(f"a prompt must be text, token ids or chat messages; got {type(prompt).__name__}")


def _token_list(ids: object) -> list[int]:
    """A plain list of ints (numpy integers accepted; bools, floats and strings are not)."""
    if isinstance(ids, (list, tuple)):
        try:
            if not any(isinstance(t, bool) for t in ids):
                return [operator.index(t) for t in ids]
        except TypeError:
            pass
    raise ValueError("prompt token ids must be a list of integers")


def validate_prompt_token_ids(token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Reject empty, out-of-vocabulary or too long prompts with a clear message."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in token_ids if not (type(t) is int and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens but max_model_len is {max_model_len}; "
            "it must leave room for at least one generated token"
        )


def validate_request_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Reject a prompt + max_tokens that cannot fit in the model's context (OpenAI's 400)."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens + max_tokens} "
            f"were requested ({num_prompt_tokens} in the prompt, {max_tokens} for the completion); "
            "shorten the prompt or lower max_tokens"
        )
