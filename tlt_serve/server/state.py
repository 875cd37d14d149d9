"""What the app holds (on ``app.state.tlt``): no module globals."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import Response

from tlt_serve.config import ServerConfig
from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.server.bridge import EngineClient
from tlt_serve.server.messages import EngineInfo
from tlt_serve.server.protocol_drafter import TrainerReport
from tlt_serve.server.uploads import TensorUploads

ADMIN_TAG = "admin"  # routes that change what is served; --admin-key guards them


@dataclass
class TrainingState:
    """The front end's side of drafter training: a pause switch and the trainer's report."""

    paused: bool = False
    report: TrainerReport | None = None
    reported_at: float | None = None  # unix time of the last report
    restarts: int = 0  # trainer processes restarted by the supervisor
    pid: int | None = None  # the running trainer process (started by the supervisor)
    suspended: bool = False  # SIGSTOPped by the supervisor while load is high

    def phase(self, enabled: bool) -> str:
        """One of off / paused / suspended / training / idle (``/metrics``' trainer_state).

        ``enabled``: the server supervises a trainer; a standalone trainer is seen through
        its reports only."""
        if not enabled and self.report is None:
            return "off"
        if self.paused:
            return "paused"
        if self.suspended:
            return "suspended"
        if self.report is not None and self.report.state in ("training", "evaluating"):
            return "training"
        return "idle"


@dataclass
class ServerState:
    config: ServerConfig
    client: EngineClient
    info: EngineInfo
    tokenizer: Tokenizer
    model_name: str  # what /v1/models reports and responses echo
    uploads: TensorUploads
    started: float  # unix time the app was built
    training: TrainingState = field(default_factory=TrainingState)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tlt
    return state


def json_response(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")
