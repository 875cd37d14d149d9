"""FastAPI app factory: routes, error shape, optional API key. State lives on ``app.state``."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from tlt_serve.config import ServerConfig
from tlt_serve.models.tokenizer import Tokenizer, load_tokenizer
from tlt_serve.server.bridge import EngineClient
from tlt_serve.server.errors import error_body, install_error_handlers
from tlt_serve.server.routes_control import control_routes
from tlt_serve.server.routes_drafter import drafter_routes
from tlt_serve.server.routes_generate import generate_routes
from tlt_serve.server.routes_openai import openai_routes
from tlt_serve.server.routes_weights import weight_routes
from tlt_serve.server.state import ServerState
from tlt_serve.server.uploads import TensorUploads

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials


def build_app(
    config: ServerConfig, client: EngineClient, tokenizer: Tokenizer | None = None
) -> FastAPI:
    """The HTTP app over a started ``EngineClient`` (its ready info sizes the validation)."""
    if client.info is None:
        raise RuntimeError("build_app needs a started EngineClient (call client.start())")
    info = client.info
    state = ServerState(
        config=config,
        client=client,
        info=info,
        tokenizer=tokenizer or load_tokenizer(info.model_path),
        model_name=config.served_model_name or info.model,
        uploads=TensorUploads(),
        started=time.time(),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.uploads.discard_all()  # half-finished weight uploads leave no temp files

    app = FastAPI(
        title="tlt-serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.tlt = state
    install_error_handlers(app)
    for router in (
        generate_routes(), openai_routes(), control_routes(), weight_routes(), drafter_routes()
    ):
        app.include_router(router)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path but /health (pure ASGI, so
    streaming responses and their disconnect handling pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(got, self.expected):
            await self.app(scope, receive, send)
            return
        body = error_body(401, "missing or invalid API key (Authorization: Bearer <key>)")
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        })
        await send({"type": "http.response.body", "body": body})
