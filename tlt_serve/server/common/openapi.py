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
from fastapi.routing import APIRoute

REF = "#/components/schemas/{name}"
BODY_TYPE = "x-body-type"  # json_body's mark: install_openapi takes it off for the schema

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
    """``openapi_extra`` of a route whose JSON body decodes into ``kind`` (empty = defaults);
    the document takes ``kind``'s schema from msgspec (``install_openapi``)."""
    schema = {"$ref": REF.format(name=kind.__name__)}
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": schema}}},
            BODY_TYPE: kind}


def binary_body() -> dict[str, Any]:
    """``openapi_extra`` of a route that takes raw bytes (a safetensors chunk)."""
    schema = {"type": "string", "format": "binary"}
    return {"requestBody": {"required": True,
                            "content": {"application/octet-stream": {"schema": schema}}}}


def install_openapi(app: FastAPI, version: str) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            bodies = _body_types(app)
            doc = get_openapi(title=app.title, version=version, routes=app.routes,
                              description=app.description)
            _, components = msgspec.json.schema_components(bodies, ref_template=REF)
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


def _body_types(app: FastAPI) -> list[type]:
    """The JSON body types the routes declared (``json_body``), taken off their extras."""
    kinds: dict[str, type] = {}
    for route in app.routes:
        extra = getattr(route, "openapi_extra", None)
        if isinstance(route, APIRoute) and extra and BODY_TYPE in extra:
            kind = extra.pop(BODY_TYPE)
            kinds[kind.__name__] = kind
    return [kinds[name] for name in sorted(kinds)]
