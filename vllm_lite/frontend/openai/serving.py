"""What the completions and chat endpoints share: errors in the OpenAI shape, request priming,
stream merging, server-sent events, token strings for logprobs."""

from __future__ import annotations

import asyncio
import codecs
import functools
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Send

from vllm_lite.errors import EngineDeadError, RequestError
from vllm_lite.frontend.client import AsyncEngineClient
from vllm_lite.frontend.openai.protocol import ErrorInfo, ErrorResponse, UsageInfo
from vllm_lite.outputs import RequestOutput

_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error to answer with the given HTTP status and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=str(self),
                type=_ERROR_TYPES.get(
                    self.status, "invalid_request_error" if self.status < 500 else "server_error"
                ),
                param=self.param,
                code=self.code if self.code is not None else self.status,
            )
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def as_api_error(exc: BaseException) -> APIError:
    """The HTTP status a failure deserves: bad input 400, dead engines 503, anything else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (ValueError, RequestError)):
        return APIError(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


class PrimedStream:
    """A request whose first output has arrived, so that every input error surfaced as an
    exception before the HTTP response started; iterate it for that output and the rest."""

    def __init__(self, agen: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
        self._agen = agen
        self._first: RequestOutput | None = first

    def __aiter__(self) -> PrimedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        await self._agen.aclose()  # type: ignore[attr-defined]


async def prime(agens: list[AsyncIterator[RequestOutput]]) -> list[PrimedStream]:
    """Start every request and wait for its first output; on any failure abort them all and raise."""
    tasks = [asyncio.ensure_future(agen.__anext__()) for agen in agens]
    try:
        firsts = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for agen in agens:
            await agen.aclose()  # type: ignore[attr-defined]
        raise
    return [PrimedStream(agen, first) for agen, first in zip(agens, firsts, strict=True)]


async def merge(streams: list[PrimedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: PrimedStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class EventStreamResponse(StreamingResponse):
    """SSE response that always closes its event iterator, also when the client went away
    mid-stream: closing it is what aborts the request in the engine at once."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    elif isinstance(payload, dict):
        data = json.dumps(payload)
    else:
        data = payload
    return f"data: {data}\n\n"


async def sse_stream(events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Events as SSE, an error event if the stream fails midway, then `[DONE]`."""
    try:
        async for event in events:
            yield sse(event)
    except Exception as exc:
        yield sse(as_api_error(exc).body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield sse("[DONE]")


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 style): the character that stands for each byte.

    Printable Latin-1 bytes stand for themselves; the others are shifted past 255, in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), 256),
    ]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shift)] = b
            shift += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenStrings:
    """Text and raw bytes of single tokens (for logprobs), computed once per token id.

    A token may hold part of a UTF-8 character (byte-level BPE, byte fallback): its text then has
    U+FFFD, but its bytes are exact, so that clients can join tokens back into the text.
    """

    def __init__(self, client: AsyncEngineClient) -> None:
        self._tokenizer = client.tokenizer
        decoder = repr(getattr(getattr(self._tokenizer, "backend_tokenizer", None), "decoder", ""))
        self._byte_level = "ByteLevel" in decoder
        self._metaspace = "Metaspace" in decoder or "Replace" in decoder
        self.text = functools.lru_cache(maxsize=65536)(self._decode)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _decode(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> bytes:
        piece = None if self._tokenizer is None else self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self._tokenizer.all_special_ids:
            if self._byte_level and all(ch in _BYTE_LEVEL for ch in piece):
                return bytes(_BYTE_LEVEL[ch] for ch in piece)
            if match := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
            if self._metaspace:
                return piece.replace("\u2581", " ").encode()
        return self.text(token_id).encode()


class TextOffsets:
    """Character offsets of successive tokens in their decoded text (completions' text_offset):
    a token that completes a multi-byte character moves the offset by that one character."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_bytes: bytes) -> int:
        """The offset where this token starts; then move past it."""
        here = self.offset
        self.offset += len(self._decoder.decode(token_bytes))
        return here
