"""vLLM's RL routes beside the SGLang and OpenAI dialects, over the same engine contract:

- ``POST /inference/v1/generate``: token ids in, token ids, logprobs, prompt logprobs and
  weight-version spans out (``cache_salt`` salts the prefix cache; without ``max_tokens`` a
  sample runs to the end of the context, as vLLM's route);
- ``GET /get_world_size`` (one engine: 1), ``POST /reset_prefix_cache``;
- ``POST /pause?mode=keep|abort|wait``, ``POST /resume``, ``GET /is_paused``;
- ``POST /update_weights`` with ``{weight_dir}`` (a checkpoint directory, as prime-rl sends),
  ``POST /reload_weights`` (back to the checkpoint the server started with); a directory
  without weights (prime-rl's NCCL broadcast) and ``/load_lora_adapter`` are refused by name;
- vLLM's weight-transfer routes (``transfer.py``: ``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights {update_info}``, ``/finish_weight_update``);
- ``GET /liveness``."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from tlt_serve.contract.controls import Continue, FlushCache, UpdateWeightsFromDisk
from tlt_serve.engine.outputs import RequestResult, StepOutput
from tlt_serve.sampling_params import ParamError, SamplingParams
from tlt_serve.server.common.bridge import ControlRefused
from tlt_serve.server.common.errors import ApiError, decode_body
from tlt_serve.server.common.jobs import (
    ClientGone,
    Job,
    SampleBook,
    check_prompt,
    collect,
    make_params,
    new_rid,
    require_defaults,
    submit_all,
    until_disconnected,
    whole_vocab,
)
from tlt_serve.server.common.openapi import json_body
from tlt_serve.server.common.state import ADMIN_TAG, ServerState, get_state, json_response
from tlt_serve.server.control.routes import engine_down, fresh_stats, paused
from tlt_serve.server.openai.answer import event
from tlt_serve.server.openai.format import (
    LogprobFormatter,
    finish_str,
    merge_delta,
    stop_reason,
    usage,
)
from tlt_serve.server.openai.routes import check_model, stream_events
from tlt_serve.server.vllm.protocol import (
    GENERATE_DEFAULT_ONLY,
    SAMPLING_DEFAULT_ONLY,
    GenChoice,
    GenerateOut,
    GenerateReq,
    GenLogprobs,
    GenLogprobsContent,
    GenStreamChoice,
    GenStreamOut,
    UpdateWeightsReq,
    WeightVersionSpan,
    gen_logprob,
)
from tlt_serve.server.vllm.transfer import TransferSession, receive, transfer_routes

PAUSE_MODES = {"keep": "in_place", "abort": "abort", "wait": "drain"}  # vLLM's → ours
_FIELDS = {  # SamplingParams field → the name in this body (error messages)
    "max_new_tokens": "sampling_params.max_tokens",
    "top_logprobs": "sampling_params.logprobs",
    **{f: f"sampling_params.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "n",
                                           "stop", "stop_token_ids", "seed",
                                           "prompt_logprobs")},
}


def vllm_routes() -> APIRouter:
    router = APIRouter()
    transfer = TransferSession()
    router.include_router(transfer_routes(transfer))

    @router.post("/inference/v1/generate", openapi_extra=json_body(GenerateReq))
    async def generate(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), GenerateReq)
        check_model(st, req.model)
        job = _job(st, req)
        streams = await submit_all(st.bridge, [job])
        book = SampleBook([job])
        if req.stream:
            return StreamingResponse(stream_events(streams, book, _TokenStream(st, req, job)),
                                     media_type="text/event-stream")
        try:
            await until_disconnected(request, collect(streams, book))
        except ClientGone:
            return Response(status_code=499)
        return json_response(_response(st, req, book))

    @router.get("/liveness")
    async def liveness(request: Request) -> Response:
        return engine_down(get_state(request)) or json_response({"status": "alive"})

    @router.get("/get_world_size")
    async def world_size() -> Response:
        return json_response({"world_size": 1})  # one engine, no tensor or data parallelism

    @router.post("/reset_prefix_cache", tags=[ADMIN_TAG])
    async def reset_prefix_cache(request: Request) -> Response:
        """As vLLM: ``success`` false while requests run (their KV is held)."""
        try:
            await get_state(request).bridge.call(FlushCache())
        except ControlRefused:
            return json_response({"success": False})
        return json_response({"success": True})

    @router.post("/pause", tags=[ADMIN_TAG])
    async def pause(request: Request, mode: str = Query("abort"),
                    clear_cache: bool = Query(True)) -> Response:
        """``keep``: running requests freeze and go on after ``/resume`` with their KV;
        ``abort``: they end now with their partial output; ``wait``: they finish (nothing
        new starts), then the answer comes. ``clear_cache`` is vLLM's deprecated flag: a
        weight update empties the prefix cache anyway."""
        if mode not in PAUSE_MODES:
            raise ParamError("mode", f"must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        await paused(get_state(request), PAUSE_MODES[mode])
        return json_response({"status": "paused"})

    @router.post("/resume", tags=[ADMIN_TAG])
    async def resume(request: Request) -> Response:
        await get_state(request).bridge.call(Continue())
        return json_response({"status": "resumed"})

    @router.get("/is_paused")
    async def is_paused(request: Request) -> Response:
        return json_response({"is_paused": (await fresh_stats(get_state(request))).paused})

    @router.post("/update_weights", tags=[ADMIN_TAG], openapi_extra=json_body(UpdateWeightsReq))
    async def update_weights(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), UpdateWeightsReq)
        if req.update_info is not None:
            if req.weight_dir is not None:
                raise ParamError("weight_dir", "give weight_dir or update_info, not both")
            return await receive(st, transfer, req.update_info)
        if not req.weight_dir:
            raise ParamError("weight_dir", "give the checkpoint directory to load")
        folder = Path(req.weight_dir)
        if folder.is_dir() and not any(folder.glob("*.safetensors")):
            raise ParamError("weight_dir", f"{req.weight_dir} holds no *.safetensors weights "
                             "(prime-rl's NCCL and NIXL weight broadcasts are not served: "
                             "use its filesystem broadcast)")
        return await _load(st, req.weight_dir, "weight_dir")

    @router.post("/load_lora_adapter", tags=[ADMIN_TAG])
    @router.post("/v1/load_lora_adapter", tags=[ADMIN_TAG])
    async def load_lora_adapter() -> Response:
        """Refused at once (a 404 would have prime-rl retry for two minutes)."""
        raise ApiError(400, "LoRA adapters are not served: load the merged weights "
                       "(/update_weights {weight_dir})")

    @router.post("/reload_weights", tags=[ADMIN_TAG])
    async def reload_weights(request: Request) -> Response:
        """The weights the server started with (prime-rl: back to the base model)."""
        st = get_state(request)
        return await _load(st, st.info.model_path, "model")

    return router


async def _load(st: ServerState, path: str, field: str) -> Response:
    try:
        done = await st.bridge.call(UpdateWeightsFromDisk(path))
    except ControlRefused as err:
        raise ParamError(field, str(err)) from err
    return json_response({"message": "Weights updated", "weight_version": done.weight_version})


def _job(st: ServerState, req: GenerateReq) -> Job:
    require_defaults(req, GENERATE_DEFAULT_ONLY)
    sp = req.sampling_params
    require_defaults(sp, SAMPLING_DEFAULT_ONLY, "sampling_params.")
    check_prompt(req.token_ids, st.info, "token_ids")
    room = st.info.max_model_len - len(req.token_ids)
    if sp.max_tokens is not None and sp.max_tokens > room:
        raise ParamError("sampling_params.max_tokens", f"is too large: {sp.max_tokens} > "
                         f"{st.info.max_model_len} - {len(req.token_ids)} prompt tokens")
    params = make_params(
        _FIELDS, st.info,
        max_new_tokens=room if sp.max_tokens is None else sp.max_tokens,
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
        min_p=sp.min_p, n=sp.n, stop=sp.stop or (), stop_token_ids=sp.stop_token_ids or (),
        ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        include_stop_in_text=sp.include_stop_str_in_output, seed=sp.seed,
        logprobs=sp.logprobs is not None, top_logprobs=whole_vocab(sp.logprobs, st.info) or 0,
        prompt_logprobs=whole_vocab(sp.prompt_logprobs, st.info) if sp.prompt_logprobs
        is not None else -1,
        cache_salt=req.cache_salt if req.cache_salt is not None else sp.cache_salt,
    )
    return Job(req.request_id or new_rid(), list(req.token_ids), params)


def _response(st: ServerState, req: GenerateReq, book: SampleBook) -> GenerateOut:
    lp = LogprobFormatter(st.tokenizer)
    params = book.jobs[0].params
    eos = st.tokenizer.eos_ids
    choices = [GenChoice(k, finish_str(r.finish), stop_reason(r.finish, params, eos),
                         list(r.token_ids), _logprobs(r, params), _spans(r))
               for k, r in enumerate(book.samples)]
    first = book.samples[0]
    out = GenerateOut(
        request_id=book.jobs[0].rid, model=st.model_name, created=int(time.time()),
        choices=choices, weight_version=first.weight_version, usage=usage(book),
    )
    if first.prompt_logprobs is not None:
        out.prompt_logprobs = lp.prompt_logprobs(first.prompt_ids, first.prompt_logprobs,
                                                 params.prompt_logprobs)
    if req.return_token_ids:
        out.prompt_token_ids = list(first.prompt_ids)
    return out


def _spans(r: RequestResult) -> list[WeightVersionSpan]:
    return [WeightVersionSpan(v, s, e) for v, s, e in r.version_spans()]


class _TokenStream:
    """``/inference/v1/generate`` streamed: per chunk each sample's new tokens."""

    def __init__(self, st: ServerState, req: GenerateReq, job: Job) -> None:
        self.st, self.req, self.job = st, req, job
        self.lp = LogprobFormatter(st.tokenizer)
        self.started = False
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)

    def opening(self, book: SampleBook) -> list[bytes]:
        return []

    def chunk(self, book: SampleBook, k: int, new: list[StepOutput]) -> bytes | None:
        d, params = merge_delta(new), self.job.params
        choice = GenStreamChoice(k, finish_str(d.finish),
                                 stop_reason(d.finish, params, self.st.tokenizer.eos_ids),
                                 list(d.token_ids), _logprobs(d, params))
        if d.finish is not None:
            choice.weight_versions = _spans(book.samples[k])
        out = GenStreamOut(self.job.rid, [choice],
                           usage=None if self.include_usage else msgspec.UNSET)
        if not self.started:
            self.started = True
            if self.req.return_token_ids:
                out.prompt_token_ids = list(self.job.prompt_ids)
        if d.prompt_logprobs is not None:
            out.prompt_logprobs = self.lp.prompt_logprobs(self.job.prompt_ids,
                                                          d.prompt_logprobs,
                                                          params.prompt_logprobs)
        return event(out)

    def closing(self, book: SampleBook) -> bytes | None:
        if not self.include_usage:
            return None
        return event(GenStreamOut(self.job.rid, [], usage=usage(book)))


def _logprobs(r: RequestResult, params: SamplingParams) -> GenLogprobs | None:
    """vLLM's token-id logprobs: per token its own entry, and as ``top_logprobs`` the sampled
    token then the best others by rank, ``max(logprobs, 1)`` in all (vLLM's order; the
    sampled token's rank where it is among the top ones)."""
    if not params.logprobs:
        return None
    content = []
    shown = max(params.top_logprobs, 1)
    for token, lp, tops in zip(r.token_ids, r.logprobs, r.top_logprobs or
                               [[] for _ in r.token_ids], strict=True):
        ranked = [gen_logprob(t, v, rank) for rank, (t, v) in enumerate(tops, start=1)]
        rank = next((g.rank for g in ranked if g.token_id == token), None)
        own = gen_logprob(token, lp, rank)
        listed = [own, *(g for g in ranked if g.token_id != token)][:shown]
        content.append(GenLogprobsContent(token, lp, rank, listed, own.token))
    return GenLogprobs(content)

