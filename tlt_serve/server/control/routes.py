"""Health, info, abort, pause/continue, cache, tokenizer and metrics endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

import tlt_serve
from tlt_serve.contract.controls import PAUSE_MODES, Continue, FlushCache, GetStats, Pause
from tlt_serve.contract.reports import StatsSnapshot
from tlt_serve.models.provision import model_source
from tlt_serve.sampling_params import ParamError, SamplingParams
from tlt_serve.server.common.bridge import EngineDeadError
from tlt_serve.server.common.errors import ApiError, decode_body, error_response
from tlt_serve.server.common.jobs import Job, SampleBook, collect, new_rid, submit_all
from tlt_serve.server.common.openapi import json_body
from tlt_serve.server.common.state import ADMIN_TAG, ServerState, get_state, json_response
from tlt_serve.server.control.metrics import CONTENT_TYPE, FrontEndView, render_metrics
from tlt_serve.server.control.protocol import (
    AbortReq,
    DetokenizeOut,
    DetokenizeReq,
    PauseReq,
    TokenizeOut,
    TokenizeReq,
)

HEALTH_GENERATE_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.05
STATS_TIMEOUT_S = 5.0


def control_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        return engine_down(get_state(request)) or json_response({"status": "ok"})

    @router.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        st = get_state(request)
        if (await fresh_stats(st)).paused:
            return json_response({"status": "ok", "paused": True})  # cannot step, still healthy
        prompt = [min(st.info.eos_ids, default=0)]
        job = Job(f"HEALTH_CHECK_{new_rid()}", prompt, SamplingParams(max_new_tokens=1,
                                                                      temperature=0.0))
        try:
            streams = await submit_all(st.bridge, [job])
            await asyncio.wait_for(collect(streams, SampleBook([job])), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            return error_response(503, "engine did not generate a token in time")
        return json_response({"status": "ok"})

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def model_info(request: Request) -> Response:
        st = get_state(request)
        return json_response({
            "model_path": st.info.model_path,
            "tokenizer_path": st.info.model_path,
            "is_generation": True,
            "served_model_name": st.model_name,
            "weight_version": st.bridge.weight_version,
            "max_model_len": st.info.max_model_len,
            "vocab_size": st.info.vocab_size,
            "dtype": st.info.dtype,
            "model": st.info.model,
            "model_source": model_source(st.info.model),
        })

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def server_info(request: Request) -> Response:
        st = get_state(request)
        stats, stale = await latest_stats(st)
        return json_response({
            **_redacted_config(st),
            # What routers and RL frameworks read at the top level of SGLang's server info
            # (sglang-router: model name and parallelism; slime: enable_memory_saver).
            "model_path": st.info.model_path,
            "served_model_name": st.model_name,
            "tp_size": 1,
            "dp_size": 1,
            "enable_memory_saver": False,
            "dtype": st.info.dtype,
            "vllm_config": _vllm_config(st),
            "engine_info": dataclasses.asdict(st.info),
            "stats": dataclasses.asdict(stats),
            "weight_version": stats.weight_version,
            "paused": stats.paused,
            "stats_stale": stale,
            "in_flight": st.bridge.in_flight(),
            "cpus": sorted(os.sched_getaffinity(0)),  # what a fleet trainer may borrow idle
            "version": tlt_serve.__version__,
        })

    @router.get("/get_load")
    async def get_load(request: Request) -> Response:
        """SGLang's load report, one entry per data-parallel rank (here one): what
        sglang-router's load-aware policies and ``/get_loads`` read."""
        stats, _ = await latest_stats(get_state(request))
        return json_response([_load(stats)])

    @router.get("/v1/loads")
    async def loads(request: Request) -> Response:
        """The same as ``{"loads": [...]}`` (slime polls it until an abort has drained)."""
        stats, _ = await latest_stats(get_state(request))
        return json_response({"loads": [_load(stats)]})

    @router.post("/abort_request", tags=[ADMIN_TAG], openapi_extra=json_body(AbortReq))
    async def abort_request(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), AbortReq)
        if req.abort_all:
            st.bridge.abort_all()
        elif req.rid:
            st.bridge.abort(req.rid)
        else:
            raise ParamError("rid", "give a rid or abort_all: true")
        return json_response({"success": True})

    @router.post("/pause_generation", tags=[ADMIN_TAG], openapi_extra=json_body(PauseReq))
    async def pause(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), PauseReq)
        if req.mode not in PAUSE_MODES:
            raise ParamError("mode", f"must be one of {PAUSE_MODES}, got {req.mode!r}")
        await paused(st, req.mode)
        return json_response({"status": "ok", "message": f"generation paused ({req.mode})"})

    @router.post("/continue_generation", tags=[ADMIN_TAG])
    async def resume(request: Request) -> Response:
        await get_state(request).bridge.call(Continue())
        return json_response({"status": "ok", "message": "generation continued"})

    @router.get("/flush_cache", tags=[ADMIN_TAG])
    @router.post("/flush_cache", tags=[ADMIN_TAG])
    async def flush_cache(request: Request) -> Response:
        await get_state(request).bridge.call(FlushCache())
        return json_response({"success": True, "message": "Cache flushed."})

    @router.post("/tokenize", openapi_extra=json_body(TokenizeReq))
    async def tokenize(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), TokenizeReq)
        if (req.prompt is None) == (req.messages is None):
            raise ParamError("prompt", "give exactly one of prompt or messages")
        if req.messages is not None:
            msgs = [{"role": m.role, "content": m.content} for m in req.messages]
            try:
                ids = st.tokenizer.apply_chat_template(msgs)
            except ValueError as err:
                raise ParamError("messages", str(err)) from err
        else:
            hf = st.tokenizer.hf
            ids = list(hf.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return json_response(TokenizeOut(ids, len(ids), st.info.max_model_len))

    @router.post("/detokenize", openapi_extra=json_body(DetokenizeReq))
    async def detokenize(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), DetokenizeReq)
        bad = next((t for t in req.tokens if not 0 <= t < st.info.vocab_size), None)
        if bad is not None:
            raise ParamError("tokens", f"token id {bad} outside vocabulary")
        text = st.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
        return json_response(DetokenizeOut(text, text))

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        st = get_state(request)
        try:
            stats: StatsSnapshot | None = await fresh_stats(st)
        except (EngineDeadError, ApiError):
            stats = st.bridge.stats  # last known: still worth scraping
        view = FrontEndView(
            model=st.model_name,
            alive=st.bridge.alive,
            in_flight=st.bridge.in_flight(),
            trainer_state=st.training.phase(st.config.training.enabled),
        )
        return Response(render_metrics(stats, view), media_type=CONTENT_TYPE)

    return router


def engine_down(st: ServerState) -> Response | None:
    """A 503 naming why, while the engine is not running (or stopping); else None."""
    bridge = st.bridge
    if bridge.alive and not bridge.closing:
        return None
    return error_response(503, f"engine is not running: {bridge.dead_reason or 'stopping'}")


async def paused(st: ServerState, mode: str) -> None:
    """Pause the engine; a drain returns once the running requests have finished."""
    await st.bridge.call(Pause(mode))
    while mode == "drain" and not (await fresh_stats(st)).paused:
        await asyncio.sleep(DRAIN_POLL_S)


async def fresh_stats(st: ServerState) -> StatsSnapshot:
    """Stats from the engine between two steps; 503 + Retry-After when a step (e.g. a big
    prefill on a loaded CPU) keeps it from answering within ``STATS_TIMEOUT_S``."""
    try:
        return await st.bridge.call(GetStats(), timeout=STATS_TIMEOUT_S)
    except asyncio.TimeoutError as err:  # not the builtin before Python 3.11
        raise ApiError(503, f"engine busy: no stats within {STATS_TIMEOUT_S:.0f} s",
                       headers={"Retry-After": "1"}) from err


async def latest_stats(st: ServerState) -> tuple[StatsSnapshot, bool]:
    """Fresh stats, else the last ones the engine pushed; the flag says they are stale."""
    try:
        return await fresh_stats(st), False
    except ApiError:
        if st.bridge.stats is None:
            raise
        return st.bridge.stats, True


def _load(stats: StatsSnapshot) -> dict[str, int]:
    return {
        "dp_rank": 0,
        "num_reqs": stats.running + stats.waiting,
        "num_running_reqs": stats.running,
        "num_waiting_reqs": stats.waiting,
        "num_tokens": stats.kv_tokens,
    }


def _vllm_config(st: ServerState) -> dict[str, Any]:
    """What vLLM's ``/server_info`` clients read of its ``vllm_config`` (TRL). No vLLM
    weight-transfer engine: TRL's ``init_communicator`` joins vLLM's own NCCL rendezvous,
    which this server does not speak, and says so; no LoRA. Logprobs are after temperature
    (where top-k / top-p / min-p cut, of the uncut distribution, as SGLang's)."""
    return {
        "model_config": {"model": st.model_name, "max_model_len": st.info.max_model_len,
                         "dtype": st.info.dtype, "logprobs_mode": "processed_logprobs"},
        "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
        "lora_config": None,
        "weight_transfer_config": None,
    }


def _redacted_config(st: ServerState) -> dict[str, Any]:
    cfg = dataclasses.asdict(st.config)
    for key in ("api_key", "admin_key"):
        if cfg.get(key):
            cfg[key] = "<set>"  # never echo a key
    return cfg
