"""FastAPI app factory: routes, error shape, optional API and admin keys.

State lives on ``app.state``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import tlt_serve
from tlt_serve.config import ServerConfig
from tlt_serve.models.tokenizer import Tokenizer, load_tokenizer
from tlt_serve.server.common.bridge import Bridge
from tlt_serve.server.common.errors import install_error_handlers
from tlt_serve.server.common.middleware import install_auth, install_body_limit
from tlt_serve.server.common.openapi import install_openapi
from tlt_serve.server.common.state import ServerState
from tlt_serve.server.common.uploads import TensorUploads
from tlt_serve.server.control.drafter import drafter_routes
from tlt_serve.server.control.routes import control_routes
from tlt_serve.server.control.weights import weight_routes
from tlt_serve.server.openai.routes import openai_routes
from tlt_serve.server.openai.tools import resolve_parser
from tlt_serve.server.sglang.routes import generate_routes
from tlt_serve.server.vllm.routes import vllm_routes


def build_app(
    config: ServerConfig, bridge: Bridge, tokenizer: Tokenizer | None = None
) -> FastAPI:
    """The HTTP app over a started ``Bridge`` (its ready info sizes the validation)."""
    if bridge.info is None:
        raise RuntimeError("build_app needs a started Bridge (call bridge.start())")
    info = bridge.info
    tok = tokenizer or load_tokenizer(info.model_path)
    state = ServerState(
        config=config,
        bridge=bridge,
        info=info,
        tokenizer=tok,
        model_name=config.served_model_name or info.model,
        uploads=TensorUploads(),
        started=time.time(),
        tool_parser=resolve_parser(config.tool_call_parser, tok.hf.chat_template),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.uploads.discard_all()  # half-finished weight uploads leave no temp files

    app = FastAPI(
        title="tlt-serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
        lifespan=lifespan, description="RL rollout server: SGLang-native, OpenAI and vLLM RL APIs",
    )
    app.state.tlt = state
    install_error_handlers(app)
    routers = (
        generate_routes(), openai_routes(), vllm_routes(), control_routes(), weight_routes(),
        drafter_routes(),
    )
    for router in routers:
        app.include_router(router)
    install_openapi(app, tlt_serve.__version__)
    install_body_limit(app, config.max_body_bytes)
    install_auth(app, routers, config.api_key, config.admin_key)  # outermost: no key, no body read
    return app
