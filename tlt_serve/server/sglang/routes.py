"""SGLang-native ``POST /generate`` (single, batch, n>1, SSE streaming)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from tlt_serve.engine.request import FinishReason, PromptLogprobs
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.server.common.bridge import EngineDeadError
from tlt_serve.server.common.errors import decode_body, error_body
from tlt_serve.server.common.jobs import (
    KEEPALIVE,
    ClientGone,
    SampleBook,
    collect,
    keepalive,
    merged,
    sse_event,
    submit_all,
    token_texts,
    until_disconnected,
)
from tlt_serve.server.common.openapi import json_body
from tlt_serve.server.common.state import ServerState, get_state, json_response
from tlt_serve.server.common.streams import RequestStream
from tlt_serve.server.sglang.inputs import generate_jobs
from tlt_serve.server.sglang.protocol import FinishReasonOut, GenerateOut, GenerateReq, MetaInfo


def generate_routes() -> APIRouter:
    router = APIRouter()

    @router.put("/generate", openapi_extra=json_body(GenerateReq))
    @router.post("/generate", openapi_extra=json_body(GenerateReq))
    async def generate(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), GenerateReq)
        jobs, single = generate_jobs(req, st.tokenizer, st.info)
        streams = await submit_all(st.bridge, jobs)
        book = SampleBook(jobs)
        fmt = _Formatter(st, req)
        if req.stream:
            return StreamingResponse(_sse(streams, book, fmt), media_type="text/event-stream")
        try:
            await until_disconnected(request, collect(streams, book))
        except ClientGone:
            return Response(status_code=499)
        outs = [fmt.output(book, k) for k in range(len(book.samples))]
        return json_response(outs[0] if single else outs)

    return router


async def _sse(
    streams: list[RequestStream], book: SampleBook, fmt: _Formatter
) -> AsyncIterator[bytes]:
    """SGLang's default stream: each event carries the sample's cumulative text/ids/meta_info."""
    indexed = len(book.samples) > 1
    try:
        async for outs in keepalive(merged(streams)):
            if outs is None:
                yield KEEPALIVE
                continue
            for k in book.absorb(outs):
                out = fmt.output(book, k)
                if indexed:
                    out.index = k
                yield sse_event(msgspec.json.encode(out))
    except EngineDeadError as err:
        yield sse_event(error_body(503, str(err)))
    yield b"data: [DONE]\n\n"


class _Formatter:
    def __init__(self, st: ServerState, req: GenerateReq) -> None:
        self.st = st
        self.text_in_logprobs = req.return_text_in_logprobs

    def output(self, book: SampleBook, k: int) -> GenerateOut:
        r, params = book.samples[k], book.job(k).params
        meta = MetaInfo(
            id=r.rid,
            finish_reason=finish_out(r.finish, params),
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.token_ids),
            cached_tokens=r.cached_tokens,
            weight_version=r.weight_version,
            weight_versions=r.weight_versions,  # encoded before the next output mutates it
            e2e_latency=book.elapsed(),
        )
        if self.st.info.spec.enabled:
            forwards = r.spec.forwards(len(r.token_ids))
            meta.spec_verify_ct = forwards
            meta.spec_accept_length = len(r.token_ids) / forwards if forwards else 0.0
            meta.spec_accept_rate = r.spec.accept_rate
            meta.spec_accept_token_num = r.spec.accepted
            meta.spec_draft_token_num = r.spec.drafted
            meta.spec_draft_steps = r.spec.verify_ct
            versions = list(r.spec.drafter_versions)
            meta.drafter_versions = versions
            meta.drafter_version = versions[-1] if versions else None
        if params.logprobs:
            texts = self._texts(r.token_ids)
            meta.output_token_logprobs = [
                (lp, t, s) for lp, t, s in zip(r.logprobs, r.token_ids, texts, strict=True)
            ]
            if params.top_logprobs:
                meta.output_top_logprobs = [self._top(pos) for pos in r.top_logprobs]
        if r.prompt_logprobs is not None:
            self._input_logprobs(meta, r.prompt_logprobs, r.prompt_ids, params.top_logprobs)
        return GenerateOut(text=r.text, output_ids=r.token_ids, meta_info=meta)

    def _input_logprobs(self, meta: MetaInfo, scored: PromptLogprobs, prompt: list[int],
                        top_n: int) -> None:
        ids = prompt[scored.start :]
        texts = self._texts(ids)
        meta.input_token_logprobs = [
            (lp, t, s) for lp, t, s in zip(scored.logprobs, ids, texts, strict=True)
        ]
        if top_n:
            meta.input_top_logprobs = [
                self._top(pos) if lp is not None else None
                for pos, lp in zip(scored.top, scored.logprobs, strict=True)
            ]

    def _texts(self, ids: list[int]) -> list[str | None]:
        if not self.text_in_logprobs:
            return [None] * len(ids)
        return list(token_texts(self.st.tokenizer, ids))

    def _top(self, pos: list[tuple[int, float]]) -> list[tuple[float, int, str | None]]:
        ids = [t for t, _ in pos]
        texts = self._texts(ids)
        return [(lp, t, s) for (t, lp), s in zip(pos, texts, strict=True)]


def finish_out(fin: FinishReason | None, params: SamplingParams) -> FinishReasonOut | None:
    if fin is None:
        return None
    if fin.type == "length":
        return FinishReasonOut("length", None, length=params.max_new_tokens)
    if fin.type == "abort":
        return FinishReasonOut("abort", None, message="request aborted")
    return FinishReasonOut(fin.type, fin.matched)
