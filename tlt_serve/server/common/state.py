"""What the app holds (on ``app.state.tlt``): no module globals."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import Response

from tlt_serve.config import ServerConfig
from tlt_serve.contract.reports import EngineInfo
from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.server.common.bridge import Bridge
from tlt_serve.server.common.training import TrainingState
from tlt_serve.server.common.uploads import TensorUploads

ADMIN_TAG = "admin"  # routes that change what is served; --admin-key guards them


@dataclass
class ServerState:
    config: ServerConfig
    bridge: Bridge
    info: EngineInfo
    tokenizer: Tokenizer
    model_name: str  # what /v1/models reports and responses echo
    uploads: TensorUploads
    started: float  # unix time the app was built
    tool_parser: str | None = None  # the chat answers' tool-call format (None: not parsed)
    training: TrainingState = field(default_factory=TrainingState)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tlt
    return state


def json_response(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")
