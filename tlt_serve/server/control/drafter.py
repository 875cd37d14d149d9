"""Drafter endpoints: hot-swap, info, training control, and the trainer's data feed.

- ``POST /update_drafter_from_disk {path, version?}``: validated, then served from the next
  engine step; in-flight requests go on (their responses list every drafter version used).
- ``GET /get_drafter_info``: serving drafter version, recent accept length, capture buffer,
  training state (paused, gate, the trainer's last report).
- ``POST /pause_drafter_training`` / ``/resume_drafter_training``.
- For the trainer: ``GET /drafter/gate`` (may it train now: spare capacity, not paused),
  ``GET /drafter/samples?after=SEQ&max_bytes=N[&share=true]`` (captured samples, safetensors
  blob; ``share``: a trainer on this machine, which may get the features by reference),
  ``GET /drafter/target`` (the target's embedding / norm / head + config, safetensors blob),
  ``POST /drafter/trainer_status`` (its report).
"""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tlt_serve.contract.controls import (
    GetDrafterInfo,
    GetDrafterTarget,
    TakeSamples,
    UpdateDrafterFromDisk,
)
from tlt_serve.sampling_params import ParamError
from tlt_serve.server.common.errors import decode_body
from tlt_serve.server.common.openapi import json_body
from tlt_serve.server.common.state import ADMIN_TAG, ServerState, get_state, json_response
from tlt_serve.server.common.training import TrainerReport
from tlt_serve.server.control.protocol import GateOut, UpdateDrafterOut, UpdateDrafterReq

BLOB = "application/octet-stream"


def drafter_routes() -> APIRouter:
    router = APIRouter()

    @router.post(
        "/update_drafter_from_disk", tags=[ADMIN_TAG], openapi_extra=json_body(UpdateDrafterReq)
    )
    async def update_from_disk(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), UpdateDrafterReq)
        if not req.path:
            raise ParamError("path", "must be a drafter checkpoint directory")
        if req.version is not None and req.version < 0:
            raise ParamError("version", f"must be >= 0, got {req.version}")
        r = await st.bridge.call(UpdateDrafterFromDisk(req.path, req.version))
        out = UpdateDrafterOut(r.success, r.message, r.drafter_version)
        return json_response(out, status=200 if out.success else 400)

    @router.get("/get_drafter_info")
    async def drafter_info(request: Request) -> Response:
        st = get_state(request)
        info = dataclasses.asdict(await st.bridge.call(GetDrafterInfo()))
        tr = st.training
        info["training"] = {
            "enabled": st.config.training.enabled,
            "paused": tr.paused,
            "gate": gate(st),
            "trainer": tr.report,
            "reported_at": tr.reported_at,
            "restarts": tr.restarts,
            "pid": tr.pid,
            "suspended": tr.suspended,
        }
        return json_response(info)

    @router.post("/pause_drafter_training", tags=[ADMIN_TAG])
    async def pause_training(request: Request) -> Response:
        get_state(request).training.paused = True
        return json_response({"success": True, "paused": True})

    @router.post("/resume_drafter_training", tags=[ADMIN_TAG])
    async def resume_training(request: Request) -> Response:
        get_state(request).training.paused = False
        return json_response({"success": True, "paused": False})

    @router.get("/drafter/gate", tags=[ADMIN_TAG])
    async def get_gate(request: Request) -> Response:
        return json_response(gate(get_state(request)))

    @router.get("/drafter/samples", tags=[ADMIN_TAG])
    async def samples(
        request: Request, after: int = 0, max_bytes: int = 64 << 20, share: bool = False
    ) -> Response:
        st = get_state(request)
        if after < 0:
            raise ParamError("after", f"must be >= 0, got {after}")
        if max_bytes < 1:
            raise ParamError("max_bytes", f"must be >= 1, got {max_bytes}")
        taken = await st.bridge.call(TakeSamples(after, max_bytes, share))
        headers = {
            "x-count": str(taken.count),
            "x-last-seq": str(taken.last_seq),
            "x-newest-seq": str(taken.newest_seq),
        }
        return Response(taken.data, media_type=BLOB, headers=headers)

    @router.get("/drafter/target", tags=[ADMIN_TAG])
    async def target(request: Request) -> Response:
        feed = await get_state(request).bridge.call(GetDrafterTarget())
        return Response(feed.data, media_type=BLOB,
                        headers={"x-weight-version": feed.weight_version})

    @router.post(
        "/drafter/trainer_status", tags=[ADMIN_TAG], openapi_extra=json_body(TrainerReport)
    )
    async def trainer_status(request: Request) -> Response:
        st = get_state(request)
        st.training.report = decode_body(await request.body(), TrainerReport)
        st.training.reported_at = time.time()
        return json_response({"success": True, "paused": st.training.paused})

    return router


def gate(st: ServerState) -> GateOut:
    """Spare capacity: at most ``max_running`` requests in flight (running or queued)."""
    limit = st.config.training.max_running
    busy = st.bridge.in_flight()
    if st.training.paused:
        ok, reason = False, "training paused"
    elif st.config.training.busy(busy):
        ok, reason = False, f"{busy} requests in flight > {limit}"
    else:
        ok, reason = True, "idle enough"
    return GateOut(ok, reason, busy, limit, st.training.paused, st.bridge.weight_version)
