"""Tokenizer loading (local files only) and chat-template rendering."""

from __future__ import annotations

import functools
from typing import Any

from vllm_lite.config import ModelConfig, ModelSource, resolve_model


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The model's HF tokenizer: from --tokenizer if given, else from the model's own files."""
    source = resolve_model(model_config.tokenizer) if model_config.tokenizer else model_config.source
    return _load(source)


@functools.lru_cache(maxsize=4)
def _load(source: ModelSource) -> Any:
    # Cached: building a tokenizer from GGUF metadata takes seconds. Tokenizers are not mutated.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.directory, **source.from_pretrained_kwargs())


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None
) -> list[int]:
    """Render chat messages with the model's (or the given) template, ready for generation."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass one with --chat-template")
    try:
        ids = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=True, tokenize=True
        )
    except ValueError:
        raise
    except Exception as exc:
        # Templates reject conversations they do not support (roles, order) by raising; that is
        # the request's fault, not the server's.
        raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
    # transformers 5 returns a BatchEncoding-like mapping where 4.x returned a list.
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
