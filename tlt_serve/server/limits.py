"""Request-size limit in front of every route: JSON bodies above ``max_body_bytes`` get 413
before they are buffered (the declared length is checked first; a chunked body is counted
as it arrives). Weight uploads are exempt: they stream to disk chunk by chunk."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tlt_serve.server.errors import ApiError, send_error

STREAMED_PATHS = frozenset({"/update_weights_from_tensor"})


def install_body_limit(app: FastAPI, max_bytes: int) -> None:
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes)


def _too_large(max_bytes: int) -> str:
    return f"request body is larger than the server's limit of {max_bytes} bytes (--max-body-mb)"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in STREAMED_PATHS:
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, 413, _too_large(self.max_bytes), "body")
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise ApiError(413, _too_large(self.max_bytes), "body")
            return message

        await self.app(scope, counted, send)
