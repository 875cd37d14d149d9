"""One error shape for every endpoint: OpenAI's ``{"error": {message, type, param, code}}``.

Exceptions raised anywhere in a route become 4xx/5xx JSON here; bad input is never a 500.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from tlt_serve.sampling_params import ParamError
from tlt_serve.server.common.bridge import (
    ControlCrashed,
    ControlRefused,
    EngineDeadError,
    RequestRejected,
)

log = logging.getLogger("tlt_serve.server")
T = TypeVar("T")
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = dict(headers or {})


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    err = {"message": message, "type": _TYPES.get(status, "server_error"),
           "param": param, "code": status}
    return msgspec.json.encode({"error": err})


def error_response(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> Response:
    body = error_body(status, message, param)
    return Response(body, status, dict(headers or {}), media_type="application/json")


async def send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    """Answer with the error shape from ASGI middleware (before any route ran)."""
    body = error_body(status, message, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def decode_body(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into ``kind``; an empty body means "all defaults"."""
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.ValidationError as err:
        raise ApiError(400, f"invalid request: {err}", _param_of(str(err))) from err
    except msgspec.DecodeError as err:
        raise ApiError(400, f"body is not valid JSON: {err}", "body") from err


def _param_of(message: str) -> str | None:
    """`$.sampling_params.temperature` → "sampling_params.temperature" (plus unknown names)."""
    path = _PATH.search(message)
    unknown = _UNKNOWN.search(message)
    base = path.group(1) if path else ""
    if unknown:
        return f"{base}.{unknown.group(1)}" if base else unknown.group(1)
    return base or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, err: ApiError) -> Response:
        return error_response(err.status, err.message, err.param, err.headers)

    @app.exception_handler(ParamError)
    async def _param(_: Request, err: ParamError) -> Response:
        return error_response(400, str(err), err.field)

    @app.exception_handler(RequestRejected)
    async def _rejected(_: Request, err: RequestRejected) -> Response:
        if err.kind == "overflow":
            return error_response(503, err.message, None, {"Retry-After": "1"})
        return error_response(400, err.message, err.param)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, err: EngineDeadError) -> Response:
        return error_response(503, str(err))

    @app.exception_handler(ControlRefused)
    async def _refused(_: Request, err: ControlRefused) -> Response:
        return error_response(400, str(err), err.refused.field)

    @app.exception_handler(ControlCrashed)
    async def _crashed(_: Request, err: ControlCrashed) -> Response:
        log.error("engine control failed: %s", err)  # its traceback is in the engine's log
        return error_response(500, f"internal error in the engine: {err}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> Response:
        return error_response(err.status_code, str(err.detail), None, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> Response:
        first = err.errors()[0] if err.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "body"))
        return error_response(400, f"invalid request: {loc}: {first.get('msg', '')}", loc or None)

    @app.exception_handler(Exception)
    async def _internal(_: Request, err: Exception) -> Response:
        log.exception("internal error")
        return error_response(500, f"internal error: {type(err).__name__}")
