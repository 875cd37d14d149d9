"""ASGI middleware in front of every route (pure ASGI, so streaming responses and their
disconnect handling pass through untouched).

- Bearer keys. Two optional keys: the API key opens every path but the open ones (/health);
  the admin key opens the admin routes (those tagged ``admin``: weight updates, pause,
  flush, abort, drafter control) and, being the stronger key, every other path too. With an
  admin key set, the API key no longer opens admin routes (403). With only an API key, it
  opens everything. Keys are compared in constant time and never echoed, logged or put in
  errors.
- Body size. JSON bodies above ``max_body_bytes`` get 413 before they are buffered (the
  declared length is checked first; a chunked body is counted as it arrives). Weight uploads
  are exempt: they stream to disk chunk by chunk.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tlt_serve.server.common.errors import ApiError, send_error
from tlt_serve.server.common.state import ADMIN_TAG

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials


def admin_paths(routers: Iterable[APIRouter]) -> frozenset[str]:
    return frozenset(
        r.path for router in routers for r in router.routes
        if isinstance(r, APIRoute) and ADMIN_TAG in r.tags
    )


def install_auth(
    app: FastAPI, routers: Iterable[APIRouter], api_key: str | None, admin_key: str | None
) -> None:
    """``routers``: the app's routers (their routes tagged ``admin`` are the admin paths)."""
    if api_key or admin_key:
        app.add_middleware(
            KeyMiddleware, api_key=api_key, admin_key=admin_key,
            admin_paths=admin_paths(routers),
        )


def _bearer(key: str | None) -> bytes | None:
    return f"Bearer {key}".encode() if key else None


class KeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        admin_key: str | None,
        admin_paths: frozenset[str],
    ) -> None:
        self.app = app
        self.api = _bearer(api_key)
        self.admin = _bearer(admin_key)
        self.admin_paths = admin_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        is_admin = self.admin is not None and hmac.compare_digest(got, self.admin)
        is_user = self.api is not None and hmac.compare_digest(got, self.api)
        if self.admin is not None and scope["path"] in self.admin_paths:
            if is_admin:
                await self.app(scope, receive, send)
            elif is_user:
                await send_error(send, 403, "this endpoint needs the admin key")
            else:
                await send_error(send, 401, "missing or invalid admin key (Authorization: "
                                 "Bearer <admin key>)")
            return
        if self.api is None or is_user or is_admin:
            await self.app(scope, receive, send)
            return
        await send_error(send, 401, "missing or invalid API key (Authorization: Bearer <key>)")


# ---- body size ---------------------------------------------------------------------------

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
