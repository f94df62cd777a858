"""Input processing: any accepted prompt form -> validated token ids, before anything is sent."""

from __future__ import annotations

from typing import Any

from vllm_lite.config import ModelConfig
from vllm_lite.inputs import (
    PromptType,
    prompt_text,
    tokenize_prompt,
    validate_prompt_token_ids,
    validate_request_length,
)
from vllm_lite.protocol.sampling_params import SamplingParams


class InputProcessor:
    """Tokenizes (chat template included) and validates requests; every problem is a ValueError
    whose message can go to the user as is."""

    def __init__(self, model_config: ModelConfig, max_model_len: int, tokenizer: Any) -> None:
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def process(
        self, prompt: PromptType, params: SamplingParams, chat_template: str | None = None
    ) -> tuple[list[int], str | None]:
        """The prompt's token ids and, when it was text, the text."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams; got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this client was made with skip_tokenizer_init")
        token_ids = tokenize_prompt(self.tokenizer, prompt, chat_template)
        validate_prompt_token_ids(token_ids, self.vocab_size, self.max_model_len)
        validate_request_length(len(token_ids), params.max_tokens, self.max_model_len)
        return token_ids, prompt_text(prompt)
