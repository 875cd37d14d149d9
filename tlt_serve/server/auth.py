"""Bearer-key checks in front of every route (pure ASGI, so streaming responses and their
disconnect handling pass through untouched).

Two optional keys: the API key opens every path but the open ones (/health); the admin key
opens the admin routes (those tagged ``admin``: weight updates, pause, flush, abort, drafter
control) and, being the stronger key, every other path too. With an admin key set, the API
key no longer opens admin routes (403). With only an API key, it opens everything.
Keys are compared in constant time and never echoed, logged or put in errors.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from tlt_serve.server.errors import send_error
from tlt_serve.server.state import ADMIN_TAG

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
