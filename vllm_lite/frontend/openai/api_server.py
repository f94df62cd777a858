"""The OpenAI-compatible HTTP server: a FastAPI app around one `AsyncEngineClient`.

Lifecycle of `vllm-lite serve`: bind the port first (a port in use fails before any model is
loaded), start the engine cores, serve with uvicorn (uvloop, httptools). On SIGTERM or Ctrl-C
uvicorn stops accepting, lets in-flight requests finish for up to --shutdown-timeout seconds and
cancels the rest (which aborts them in the engines); then every engine process is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_lite import __version__
from vllm_lite.frontend.client import AsyncEngineClient
from vllm_lite.frontend.metrics import CONTENT_TYPE
from vllm_lite.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    now,
)
from vllm_lite.frontend.openai.serving import APIError, as_api_error
from vllm_lite.frontend.openai.serving_chat import ServingChat
from vllm_lite.frontend.openai.serving_completion import ServingCompletion
from vllm_lite.signals import exit_on_termination

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0
# After draining, how long responses may take to reach their clients before connections close.
FLUSH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs beyond the engine: names, auth, template."""

    model_name: str
    api_key: str | None = None
    chat_template: str | None = None


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run a handler, cancelling it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return task.result() if task.done() and not task.cancelled() else await task
    return Response(status_code=499)  # the client is gone; nobody reads this


class APIKeyMiddleware:
    """401 for /v1/* without `Authorization: Bearer KEY` (plain ASGI: streaming and disconnect
    detection pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = APIError(401, "invalid or missing API key", code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(client: AsyncEngineClient, server: ServerConfig) -> FastAPI:
    """The FastAPI app: OpenAI routes, health, version, metrics, OpenAI-shaped errors."""
    app = FastAPI(title="vllm-lite", version=__version__)
    completions = ServingCompletion(client, server.model_name)
    chat = ServingChat(client, server.model_name, server.chat_template)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = list(first.get("loc", ()))
        # loc is ("body", field, ...): the field is the parameter; the rest names union members.
        param = str(loc[1]) if len(loc) > 1 and loc[0] == "body" else None
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif param is None:
            message = "the request body must be a JSON object"
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}"
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    if server.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server.api_key)

    def check_model(name: str | None) -> None:
        if name and name != server.model_name:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")

    async def serve(request: Request, handler: Callable[[], Awaitable[Response]]) -> Response:
        async def guarded() -> Response:
            try:
                return await handler()
            except Exception as exc:
                error = as_api_error(exc)
                if error.status >= 500 and error.status != 503:
                    logger.exception("request failed")
                return error.response()

        return await run_unless_disconnected(request, guarded())

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await serve(request, lambda: completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await serve(request, lambda: chat.create(body))

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=server.model_name,
                    created=now(),
                    root=client.config.model_config.model,
                    max_model_len=client.max_model_len,
                )
            ]
        )

    @app.get("/health")
    async def health() -> Response:
        try:
            await client.check_health()
        except Exception as exc:
            return APIError(503, str(exc)).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        # Fresh engine figures: after aborts no step may have reported the lower load yet.
        with contextlib.suppress(Exception):
            fresh = (client.get_engine_stats(rank) for rank in client.live_engines())
            await asyncio.wait_for(asyncio.gather(*fresh), STATS_TIMEOUT_S)
        assert client.metrics is not None
        return Response(client.metrics.render(), media_type=CONTENT_TYPE)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP port before the engines load, so that a taken port fails in a second."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, but its shutdown first lets requests in flight finish for `drain_timeout_s`,
        then aborts the rest through the client, so that each ends properly (finish_reason
        'abort', `data: [DONE]`) before the connections close."""

        def __init__(self, config: Any, client: AsyncEngineClient, drain_timeout_s: float) -> None:
            super().__init__(config)
            self.client = client
            self.drain_timeout_s = drain_timeout_s

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            for server in self.servers:
                server.close()  # stop accepting at once
            requests = self.client.output_processor.requests
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.drain_timeout_s
            if requests:
                logger.warning("draining %d request(s) for up to %.0f s", len(requests), self.drain_timeout_s)
            while requests and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            if requests:
                logger.warning("aborting %d request(s) still running", len(requests))
            for request_id in list(requests):
                await self.client.abort(request_id)
            await super().shutdown(sockets)

    return DrainingServer


def run_server(args: Any) -> int:
    """`vllm-lite serve`: bind, start the engines, serve until SIGTERM / Ctrl-C, stop everything."""
    import uvicorn

    from vllm_lite.config import EngineArgs
    from vllm_lite.frontend.metrics import Metrics

    # SIGTERM / Ctrl-C before uvicorn runs (engines loading) or re-raised by uvicorn once it has
    # drained (it hands captured signals back to the previous handler): unwind through the
    # `finally` below, which stops the engines, and exit 0.
    exit_on_termination()
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    server = ServerConfig(
        model_name=config.model_config.name,
        api_key=args.api_key or os.environ.get("VLLM_LITE_API_KEY") or None,
        chat_template=load_chat_template(args.chat_template),
    )
    sock = bind_socket(args.host, args.port)
    client = AsyncEngineClient(config, metrics=Metrics(server.model_name), log_level=args.log_level.upper())
    try:
        app = build_app(client, server)
        uv_config = uvicorn.Config(
            app,
            loop="uvloop",
            http="httptools",
            log_level=args.log_level,
            # Draining is DrainingServer's; this only bounds the flush of responses after it.
            timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
            access_log=args.log_level == "debug",
        )
        logger.warning(
            "serving %s on http://%s:%d (%d KV blocks)",
            server.model_name,
            args.host,
            args.port,
            sum(client.num_kv_blocks.values()),
        )
        _draining_server_class()(uv_config, client, args.shutdown_timeout).run(sockets=[sock])
    finally:
        client.shutdown()
        sock.close()
    return 0
