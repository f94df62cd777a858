"""`POST /v1/completions`: one or many prompts, n samples each, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from vllm_lite.frontend.client import AsyncEngineClient
from vllm_lite.frontend.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now,
    random_id,
)
from vllm_lite.frontend.openai.serving import (
    EventStreamResponse,
    PrimedStream,
    TextOffsets,
    TokenStrings,
    merge,
    prime,
    sse_stream,
    usage,
)
from vllm_lite.outputs import CompletionOutput
from vllm_lite.protocol.step import SampleLogprobs


class CompletionLogprobsBuilder:
    """Completions-API logprobs: token strings, their logprobs, top alternatives, text offsets."""

    def __init__(self, tokens: TokenStrings) -> None:
        self.tokens = tokens

    def build(self, entries: list[SampleLogprobs], offsets: TextOffsets) -> CompletionLogprobs:
        """Logprobs of `entries`; `offsets` carries the position in the text across calls."""
        out = CompletionLogprobs()
        for e in entries:
            text = self.tokens.text(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(e.logprob)
            out.text_offset.append(offsets.advance(self.tokens.bytes(e.token_id)))
            top = {self.tokens.text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)}
            top.setdefault(text, e.logprob)
            out.top_logprobs.append(top)
        return out


class ServingCompletion:
    def __init__(self, client: AsyncEngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.logprobs = CompletionLogprobsBuilder(TokenStrings(client))

    async def create(self, request: CompletionRequest) -> JSONResponse | EventStreamResponse:
        params = request.to_sampling_params()
        prompts = request.prompts()
        request_id = random_id("cmpl")
        agens = [
            self.client.generate(p, params, request_id=f"{request_id}-{i}") for i, p in enumerate(prompts)
        ]
        streams = await prime(agens)
        prompt_texts = (
            [p if isinstance(p, str) else self._decode(p) for p in prompts] if request.echo else None
        )
        if request.stream:
            events = self._stream(request, request_id, streams, prompt_texts)
            return EventStreamResponse(sse_stream(events))
        return JSONResponse((await self._full(request, request_id, streams, prompt_texts)).model_dump())

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self.client.tokenizer
        return tokenizer.decode(token_ids) if tokenizer is not None else ""

    async def _full(
        self,
        request: CompletionRequest,
        request_id: str,
        streams: list[PrimedStream],
        prompt_texts: list[str] | None,
    ) -> CompletionResponse:
        finals: dict[int, tuple[int, CompletionOutput]] = {}
        prompt_tokens = 0
        async for i, out in merge(streams):
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                finals[i * request.n + c.index] = (i, c)
        choices = []
        for index in sorted(finals):
            i, c = finals[index]
            prefix = prompt_texts[i] if prompt_texts else ""
            logprobs = None
            if request.logprobs is not None:
                logprobs = self.logprobs.build(c.logprobs or [], TextOffsets(len(prefix)))
            choices.append(
                CompletionChoice(
                    index=index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        completion_tokens = sum(len(c.token_ids) for _, c in finals.values())
        return CompletionResponse(
            id=request_id,
            created=now(),
            model=self.model_name,
            choices=choices,
            usage=usage(prompt_tokens, completion_tokens),
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        streams: list[PrimedStream],
        prompt_texts: list[str] | None,
    ) -> AsyncIterator[CompletionResponse]:
        created = now()
        offsets: dict[int, TextOffsets] = {}
        prompt_tokens = completion_tokens = 0
        async for i, out in merge(streams):
            choices = []
            for c in out.outputs:
                index = i * request.n + c.index
                text = c.text
                if index not in offsets:
                    offsets[index] = TextOffsets()
                    if prompt_texts:
                        text = prompt_texts[i] + text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.logprobs.build(c.logprobs or [], offsets[index])
                completion_tokens += len(c.token_ids)
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
            if choices:
                yield CompletionResponse(
                    id=request_id, created=created, model=self.model_name, choices=choices
                )
        if request.include_usage:
            yield CompletionResponse(
                id=request_id,
                created=created,
                model=self.model_name,
                choices=[],
                usage=usage(prompt_tokens, completion_tokens),
            )
