"""vLLM's weight-transfer routes, as a trainer drives them after each RL step:

``POST /init_weight_transfer_engine {init_info}`` joins the trainer's group (rank 0, it hosts
the TCPStore rendezvous) as ``rank_offset``; each step ``/start_weight_update``, one or more
``/update_weights {update_info}`` (the tensors rank 0 then broadcasts, in order; each round
applied whole, as vLLM applies it, the weight version moving on), ``/finish_weight_update
{weight_version}`` (names the version); ``/shutdown_weight_transfer_engine`` leaves.

Over torch.distributed: gloo on a CPU, nccl where the engine runs on CUDA (``backend`` in
``init_info``). vLLM's own trainer-side engine (TRL's ``init_communicator``) speaks NCCL
through vLLM's communicator on CUDA only; a trainer on a CPU broadcasts over gloo. Packed
transfers and the unique-id rendezvous are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tlt_serve.contract.controls import DestroyWeightsUpdateGroup, UpdateWeightVersion
from tlt_serve.sampling_params import ParamError
from tlt_serve.server.common.errors import ApiError, decode_body
from tlt_serve.server.common.openapi import json_body
from tlt_serve.server.common.state import ADMIN_TAG, ServerState, get_state, json_response
from tlt_serve.server.control.weights import (
    apply_update,
    checked_version,
    join_group,
    receive_tensors,
)
from tlt_serve.server.vllm.protocol import (
    TransferFinishReq,
    TransferInitReq,
    TransferUpdateInfo,
)

GROUP = "vllm-weight-transfer"


@dataclass
class TransferSession:
    """Between ``/start_weight_update`` and ``/finish_weight_update``."""

    open: bool = False


def transfer_routes(session: TransferSession) -> APIRouter:
    router = APIRouter()

    @router.post("/init_weight_transfer_engine", tags=[ADMIN_TAG],
                 openapi_extra=json_body(TransferInitReq))
    async def init(request: Request) -> Response:
        st = get_state(request)
        info = decode_body(await request.body(), TransferInitReq).init_info
        if info.packed:
            raise ParamError("init_info.packed", "packed transfers are not supported: send "
                             "each tensor on its own (packed false)")
        if info.nccl_unique_id_b64 is not None:
            raise ParamError("init_info.nccl_unique_id_b64", "not supported: give "
                             "master_address and master_port (a TCPStore rendezvous)")
        return await apply_update(st, join_group(
            info.master_address, info.master_port, info.rank_offset, info.world_size,
            info.backend, GROUP, info.timeout_s, prefix="init_info."))

    @router.post("/start_weight_update", tags=[ADMIN_TAG])
    async def start(request: Request) -> Response:
        session.open = True
        return _message("Weight update started")

    @router.post("/finish_weight_update", tags=[ADMIN_TAG],
                 openapi_extra=json_body(TransferFinishReq))
    async def finish(request: Request) -> Response:
        st = get_state(request)
        body = await request.body()
        req = decode_body(body, TransferFinishReq) if body.strip() else TransferFinishReq()
        if not session.open:
            raise ApiError(400, "no weight update was started (/start_weight_update)")
        version = checked_version("weight_version", req.weight_version)
        session.open = False
        if version is not None:
            return await apply_update(st, UpdateWeightVersion(version))
        return _message("Weight update finished")

    @router.post("/shutdown_weight_transfer_engine", tags=[ADMIN_TAG])
    async def shutdown(request: Request) -> Response:
        session.open = False
        return await apply_update(get_state(request), DestroyWeightsUpdateGroup(GROUP))

    return router


async def receive(st: ServerState, session: TransferSession, info: TransferUpdateInfo
                  ) -> Response:
    """One ``/update_weights {update_info}`` round: the tensors rank 0 broadcasts next."""
    if not session.open:
        raise ApiError(400, "no weight update was started: call /start_weight_update first")
    if info.packed:
        raise ParamError("update_info.packed", "packed transfers are not supported")
    if not info.is_checkpoint_format:
        raise ParamError("update_info.is_checkpoint_format",
                         "only checkpoint-format names (as the model's files name them)")
    return await apply_update(st, receive_tensors(
        info.names, info.dtype_names, info.shapes, GROUP, None, False,
        prefix="update_info.", dtypes_field="dtype_names"))


def _message(text: str) -> Response:
    return json_response({"message": text})
