"""The OpenAPI document at ``/openapi.json``: FastAPI's paths plus request-body schemas.

Routes decode their bodies with msgspec (not pydantic), so FastAPI cannot see them; each
route names its body type with ``openapi_extra=json_body(Kind)`` and the JSON schemas come
from msgspec, the same types that validate the requests. Fuzzers (schemathesis) and client
generators read this document.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tlt_serve.server.protocol import (
    AbortReq,
    DestroyGroupReq,
    DetokenizeReq,
    GenerateReq,
    InitGroupReq,
    PauseReq,
    TokenizeReq,
    UpdateFromDiskReq,
    UpdateFromDistributedReq,
    UpdateWeightVersionReq,
)
from tlt_serve.server.protocol_drafter import TrainerReport, UpdateDrafterReq
from tlt_serve.server.protocol_openai import ChatReq, CompletionReq

REF = "#/components/schemas/{name}"
REQUEST_BODIES: tuple[type, ...] = (
    GenerateReq, CompletionReq, ChatReq, AbortReq, PauseReq, TokenizeReq, DetokenizeReq,
    UpdateFromDiskReq, UpdateWeightVersionReq, InitGroupReq, UpdateFromDistributedReq,
    DestroyGroupReq, UpdateDrafterReq, TrainerReport,
)

ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "integer"},
    }, "required": ["message", "type", "param", "code"]}},
    "required": ["error"],
}
ERROR_RESPONSES = {
    str(code): {"description": text, "content": {"application/json": {"schema": {
        "$ref": REF.format(name="Error")}}}}
    for code, text in (
        (400, "invalid request (error.param names the field)"),
        (401, "missing or invalid key"),
        (403, "needs the admin key"),
        (413, "request body too large"),
        (503, "queue full (Retry-After), shutting down, or the engine is gone"),
    )
}


def json_body(kind: type) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body decodes into ``kind`` (empty = defaults)."""
    if kind not in REQUEST_BODIES:
        raise ValueError(f"{kind.__name__} is not in REQUEST_BODIES (its schema would be missing)")
    schema = {"$ref": REF.format(name=kind.__name__)}
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": schema}}}}


def binary_body() -> dict[str, Any]:
    """``openapi_extra`` of a route that takes raw bytes (a safetensors chunk)."""
    schema = {"type": "string", "format": "binary"}
    return {"requestBody": {"required": True,
                            "content": {"application/octet-stream": {"schema": schema}}}}


def install_openapi(app: FastAPI, version: str) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=version, routes=app.routes,
                              description=app.description)
            _, components = msgspec.json.schema_components(REQUEST_BODIES, ref_template=REF)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):  # errors are 400s here
                schemas.pop(name, None)
            schemas.update(components, Error=ERROR_SCHEMA)
            for operations in doc["paths"].values():
                for op in operations.values():
                    op["responses"].pop("422", None)
                    op["responses"].update(ERROR_RESPONSES)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
