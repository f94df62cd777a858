"""`POST /v1/chat/completions`: a conversation through the chat template, n samples, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from vllm_lite.frontend.client import AsyncEngineClient
from vllm_lite.frontend.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    now,
    random_id,
)
from vllm_lite.frontend.openai.serving import (
    EventStreamResponse,
    PrimedStream,
    TokenStrings,
    prime,
    sse_stream,
    usage,
)
from vllm_lite.outputs import RequestOutput
from vllm_lite.protocol.step import SampleLogprobs


class ServingChat:
    def __init__(self, client: AsyncEngineClient, model_name: str, chat_template: str | None) -> None:
        self.client = client
        self.model_name = model_name
        self.chat_template = chat_template
        self.tokens = TokenStrings(client)

    async def create(self, request: ChatCompletionRequest) -> JSONResponse | EventStreamResponse:
        params = request.to_sampling_params()
        if not request.messages:
            raise ValueError("messages must not be empty")
        messages = [m.to_template_dict() for m in request.messages]
        request_id = random_id("chatcmpl")
        agen = self.client.generate(messages, params, request_id=request_id, chat_template=self.chat_template)
        (stream,) = await prime([agen])
        if request.stream:
            return EventStreamResponse(sse_stream(self._stream(request, request_id, stream)))
        return JSONResponse((await self._full(request, request_id, stream)).model_dump())

    def _logprobs(self, entries: list[SampleLogprobs] | None) -> ChatLogprobs:
        content = []
        for e in entries or []:
            text = self.tokens.text(e.token_id)
            top = [
                TopLogprob(token=self.tokens.text(tid), logprob=lp, bytes=list(self.tokens.bytes(tid)))
                for tid, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)
            ]
            content.append(
                ChatTokenLogprob(
                    token=text, logprob=e.logprob, bytes=list(self.tokens.bytes(e.token_id)), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)

    async def _full(
        self, request: ChatCompletionRequest, request_id: str, stream: PrimedStream
    ) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async for out in stream:
            final = out
        assert final is not None and final.finished
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=self._logprobs(c.logprobs) if request.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in final.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            created=now(),
            model=self.model_name,
            choices=choices,
            usage=usage(len(final.prompt_token_ids), completion_tokens),
        )

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, stream: PrimedStream
    ) -> AsyncIterator[ChatCompletionChunk]:
        created = now()
        started: set[int] = set()
        prompt_tokens = completion_tokens = 0

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices)

        async for out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            choices = []
            for c in out.outputs:
                if c.index not in started:
                    # OpenAI opens each choice with a role-only delta.
                    started.add(c.index)
                    yield chunk(
                        [ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))]
                    )
                completion_tokens += len(c.token_ids)
                choices.append(
                    ChatChunkChoice(
                        index=c.index,
                        delta=DeltaMessage(content=c.text),
                        logprobs=self._logprobs(c.logprobs) if request.logprobs else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
            if choices:
                yield chunk(choices)
        if request.include_usage:
            final = chunk([])
            final.usage = usage(prompt_tokens, completion_tokens)
            yield final
