"""Weight versions and weight updates (from disk, uploaded safetensors bytes, a gloo group).

Updates are applied by the engine process between two steps: in-flight requests keep
running and report, per sample, every weight version their steps ran under.
``GET /get_weights`` exports the served weights (a joining replica's source).
Responses use SGLang's shape ``{success, message, weight_version}`` (400 when not applied).
"""

from __future__ import annotations

import os
import tempfile

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from tlt_serve.contract.controls import (
    ControlOp,
    DestroyWeightsUpdateGroup,
    ExportWeights,
    GetInfo,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromFile,
    UpdateWeightVersion,
    WeightsUpdated,
)
from tlt_serve.sampling_params import ParamError
from tlt_serve.server.common.bridge import ControlRefused
from tlt_serve.server.common.errors import decode_body
from tlt_serve.server.common.openapi import binary_body, json_body
from tlt_serve.server.common.state import ADMIN_TAG, ServerState, get_state, json_response
from tlt_serve.server.control.protocol import (
    DestroyGroupReq,
    InitGroupReq,
    UpdateFromDiskReq,
    UpdateFromDistributedReq,
    UpdateWeightVersionReq,
    WeightUpdateOut,
)
from tlt_serve.weight_sync import DIST_DTYPES

MAX_VERSION_LEN = 128
MAX_RENDEZVOUS_S = 3600.0


def weight_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/get_weight_version")
    async def get_version(request: Request) -> Response:
        st = get_state(request)
        info = await st.bridge.call(GetInfo())
        return json_response({"weight_version": info.weight_version})

    @router.get("/get_weights", tags=[ADMIN_TAG])
    async def get_weights(request: Request) -> Response:
        """The served weights (safetensors, HF names, served dtype; metadata and header
        ``x-weight-version``): what a replica joining a fleet loads from a peer."""
        st = get_state(request)
        fd, name = tempfile.mkstemp(prefix="tlt-export-", suffix=".safetensors",
                                    dir=st.uploads.directory)
        os.close(fd)
        try:
            exported = await st.bridge.call(ExportWeights(name))
        except BaseException:
            os.unlink(name)
            raise
        headers = {"x-weight-version": exported.weight_version}
        return FileResponse(name, media_type="application/octet-stream", headers=headers,
                            background=BackgroundTask(os.unlink, name))

    @router.post(
        "/update_weight_version", tags=[ADMIN_TAG], openapi_extra=json_body(UpdateWeightVersionReq)
    )
    async def set_version(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), UpdateWeightVersionReq)
        version = checked_version("new_version", req.new_version)
        assert version is not None  # a required field
        return await apply_update(st, UpdateWeightVersion(version, req.abort_all_requests))

    @router.post(
        "/update_weights_from_disk", tags=[ADMIN_TAG], openapi_extra=json_body(UpdateFromDiskReq)
    )
    async def from_disk(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), UpdateFromDiskReq)
        if req.load_format not in (None, "auto", "safetensors"):
            raise ParamError("load_format", "only safetensors checkpoints are supported")
        version = checked_version("weight_version", req.weight_version)
        return await apply_update(st, UpdateWeightsFromDisk(req.model_path, version,
                                                      req.abort_all_requests))

    @router.post("/update_weights_from_tensor", tags=[ADMIN_TAG], openapi_extra=binary_body())
    async def from_tensor(
        request: Request,
        chunk: int = 0,
        num_chunks: int = 1,
        upload_id: str = "default",
        weight_version: str | None = None,
    ) -> Response:
        st = get_state(request)
        weight_version = checked_version("weight_version", weight_version)
        path = st.uploads.begin_chunk(upload_id, chunk, num_chunks)
        try:
            with path.open("ab") as f:
                async for piece in request.stream():
                    f.write(piece)
        except ClientDisconnect:
            st.uploads.discard(upload_id)
            return Response(status_code=499)
        except BaseException:  # e.g. disk full: never leave a half-written upload registered
            st.uploads.discard(upload_id)
            raise
        done = st.uploads.end_chunk(upload_id)
        if done is None:
            msg = f"chunk {chunk + 1}/{num_chunks} received"
            return json_response(WeightUpdateOut(True, msg, st.bridge.weight_version))
        try:
            return await apply_update(st, UpdateWeightsFromFile(str(done), weight_version))
        finally:
            done.unlink(missing_ok=True)

    @router.post(
        "/init_weights_update_group", tags=[ADMIN_TAG], openapi_extra=json_body(InitGroupReq)
    )
    async def init_group(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), InitGroupReq)
        return await apply_update(st, join_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.backend,
            req.group_name, req.timeout_s))

    @router.post(
        "/update_weights_from_distributed",
        tags=[ADMIN_TAG],
        openapi_extra=json_body(UpdateFromDistributedReq),
    )
    async def from_distributed(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), UpdateFromDistributedReq)
        if req.load_format is not None:
            raise ParamError("load_format", "not supported")
        version = checked_version("weight_version", req.weight_version)
        return await apply_update(st, receive_tensors(
            req.names, req.dtypes, req.shapes, req.group_name, version, req.abort_all_requests))

    @router.post(
        "/destroy_weights_update_group", tags=[ADMIN_TAG], openapi_extra=json_body(DestroyGroupReq)
    )
    async def destroy_group(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), DestroyGroupReq)
        return await apply_update(st, DestroyWeightsUpdateGroup(req.group_name))

    return router


def checked_version(field: str, version: str | None) -> str | None:
    """Versions travel in headers too (``x-weight-version``): 1-128 printable ASCII chars."""
    if version is None:
        return None
    if not version or len(version) > MAX_VERSION_LEN:
        raise ParamError(field, f"must be 1-{MAX_VERSION_LEN} characters, got {len(version)}")
    if not all(" " <= c <= "~" for c in version):
        raise ParamError(field, "must be printable ASCII (it is also sent as a header)")
    return version


async def apply_update(st: ServerState, op: ControlOp[WeightsUpdated]) -> Response:
    """SGLang's answer to a weight update: ``{success, message, weight_version}``, 400 (with
    the version still served) when the engine refused it."""
    try:
        done = await st.bridge.call(op)
    except ControlRefused as err:
        out = WeightUpdateOut(False, str(err), err.refused.weight_version)
        return json_response(out, status=400)
    return json_response(WeightUpdateOut(True, done.message, done.weight_version))


def join_group(
    address: str, port: int | str, rank_offset: int, world_size: int, backend: str,
    group: str, timeout_s: float, prefix: str = "",
) -> InitWeightsUpdateGroup:
    """The join of a trainer's torch.distributed group, checked (``prefix``: where the fields
    sit in the body, for errors)."""
    if backend not in ("gloo", "nccl"):
        raise ParamError(f"{prefix}backend", f"must be gloo or nccl, got {backend!r}")
    if not 0 < rank_offset < world_size:
        raise ParamError(f"{prefix}rank_offset",
                         "must be in [1, world_size): the trainer is rank 0")
    if not 0 < timeout_s <= MAX_RENDEZVOUS_S:
        raise ParamError(f"{prefix}timeout_s", f"must be in (0, {MAX_RENDEZVOUS_S:.0f}], "
                         f"got {timeout_s}")
    return InitWeightsUpdateGroup(address, _port(port, f"{prefix}master_port"), rank_offset,
                                  world_size, backend, group, timeout_s)


def receive_tensors(
    names: list[str], dtypes: list[str], shapes: list[list[int]], group: str,
    version: str | None, abort_all: bool, prefix: str = "", dtypes_field: str = "dtypes",
) -> UpdateWeightsFromDistributed:
    """An update over the group, checked here: once the engine starts receiving, it blocks
    until rank 0 sends."""
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise ParamError(f"{prefix}names",
                         f"names, {dtypes_field} and shapes must be non-empty, same length")
    plain = [d.removeprefix("torch.") for d in dtypes]
    bad = next((d for d in plain if d not in DIST_DTYPES), None)
    if bad is not None:
        raise ParamError(f"{prefix}{dtypes_field}", f"{bad!r} is not one of {sorted(DIST_DTYPES)}")
    if any(d < 0 for shape in shapes for d in shape):
        raise ParamError(f"{prefix}shapes", "dimensions must be >= 0")
    return UpdateWeightsFromDistributed(names, plain, shapes, group, version, abort_all)


def _port(value: int | str, field: str = "master_port") -> int:
    """A TCP port given as a number or a string of digits (AReaL sends a string)."""
    digits = isinstance(value, str) and value.isascii() and value.isdigit()
    port = value if isinstance(value, int) else int(value) if digits else -1
    if not 0 < port < 65536:
        raise ParamError(field, f"must be a port in [1, 65535], got {value!r}")
    return port
