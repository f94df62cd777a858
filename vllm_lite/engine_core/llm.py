"""`LLM`: offline batch generation with an in-process engine core (no sockets, no server)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from vllm_lite.config import DEFAULT_MODEL, EngineArgs
from vllm_lite.engine_core.core import EngineCore
from vllm_lite.inputs import PromptType, prompt_text, tokenize_prompt
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.tokenizer import apply_chat_template, load_tokenizer


class _Sample:
    """One of a request's n sequences while it is generated."""

    def __init__(self, index: int, params: SamplingParams) -> None:
        self.index = index
        self.params = params
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""


class LLM:
    """Generate for many prompts at once with continuous batching.

    >>> llm = LLM("smollm2-135m")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(
        self, model: str = DEFAULT_MODEL, skip_tokenizer_init: bool = False, **engine_kwargs: Any
    ) -> None:
        """`engine_kwargs` are `EngineArgs` fields; with `skip_tokenizer_init` prompts must be token
        ids and outputs carry no text."""
        self.engine_args = EngineArgs(model=model, **engine_kwargs)
        self.config = self.engine_args.create_engine_config()
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(self.config.model_config)
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; returns outputs in prompt order once all have finished."""
        prompt_list = self._as_prompt_list(prompts)
        token_lists = [self._tokenize(p) for p in prompt_list]
        texts = [prompt_text(p) for p in prompt_list]
        return self._run(token_lists, texts, sampling_params)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [apply_chat_template(self.tokenizer, conv, chat_template) for conv in conversations]
        return self._run(token_lists, [None] * len(token_lists), sampling_params)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _tokenize(self, prompt: PromptType) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt)

    def _run(
        self,
        token_lists: list[list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(token_lists)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(token_lists):
            raise ValueError(f"got {len(params_list)} sampling params for {len(token_lists)} prompts")
        for tokens in token_lists:
            self.engine.validate_prompt(tokens)
        results: list[RequestOutput] = []
        samples: dict[str, tuple[RequestOutput, _Sample]] = {}
        now = time.monotonic()
        for tokens, text, params in zip(token_lists, texts, params_list, strict=True):
            result = RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=tokens)
            results.append(result)
            for i in range(params.n):
                child = params.clone_for_sample(i)
                req_id = f"{result.request_id}-{i}"
                samples[req_id] = (result, _Sample(i, child))
                self.engine.add_request(EngineCoreRequest(req_id, tokens, child, now))
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    self._process(out, samples)
        except BaseException:
            self.engine.abort_requests(list(samples))
            raise
        for result, sample in samples.values():
            if not sample.finish_reason:
                continue
            if not sample.text:
                sample.text = self._detokenize(sample)
            result.outputs.append(
                CompletionOutput(
                    index=sample.index,
                    text=sample.text,
                    token_ids=sample.token_ids,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    logprobs=sample.logprobs if sample.params.logprobs is not None else None,
                )
            )
        for result in results:
            result.outputs.sort(key=lambda o: o.index)
            result.finished = True
        return results

    def _process(self, out: EngineCoreOutput, samples: dict[str, tuple[RequestOutput, _Sample]]) -> None:
        result, sample = samples[out.req_id]
        if sample.finish_reason:  # already ended by a stop string
            return
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            sample.logprobs.extend(out.new_logprobs)
        if out.num_cached_tokens:
            result.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            sample.finish_reason = out.finish_reason.value
            sample.stop_reason = out.stop_reason
        if sample.params.stop:
            self._check_stop_strings(out.req_id, sample)

    def _check_stop_strings(self, req_id: str, sample: _Sample) -> None:
        text = self._detokenize(sample)
        hits = [(text.find(s), s) for s in sample.params.stop if s and s in text]
        if not hits:
            return
        pos, stop = min(hits)
        sample.text = text[: pos + len(stop)] if sample.params.include_stop_str_in_output else text[:pos]
        sample.finish_reason = FinishReason.STOP.value
        sample.stop_reason = stop
        self.engine.abort_requests([req_id])

    def _detokenize(self, sample: _Sample) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(sample.token_ids, skip_special_tokens=sample.params.skip_special_tokens)
