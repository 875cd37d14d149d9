"""OpenAI-compatible ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from tlt_serve.engine.outputs import StepOutput
from tlt_serve.server.common.bridge import EngineDeadError
from tlt_serve.server.common.errors import ApiError, decode_body, error_body
from tlt_serve.server.common.jobs import (
    KEEPALIVE,
    ClientGone,
    Job,
    SampleBook,
    collect,
    keepalive,
    merged,
    sse_event,
    submit_all,
    until_disconnected,
)
from tlt_serve.server.common.openapi import json_body
from tlt_serve.server.common.state import ServerState, get_state, json_response
from tlt_serve.server.common.streams import RequestStream
from tlt_serve.server.openai.answer import CompletionAnswer
from tlt_serve.server.openai.chat_answer import ChatAnswer
from tlt_serve.server.openai.inputs import chat_job, completion_jobs
from tlt_serve.server.openai.protocol import (
    ChatReq,
    CompletionReq,
    ModelCard,
    ModelList,
)


def openai_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        st = get_state(request)
        card = ModelCard(st.model_name, int(st.started), st.info.max_model_len, st.info.model_path)
        return json_response(ModelList([card]))

    @router.post("/v1/completions", openapi_extra=json_body(CompletionReq))
    async def completions(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), CompletionReq)
        check_model(st, req.model)
        jobs = completion_jobs(req, st.tokenizer, st.info)
        return await _serve(request, st, jobs, req.stream, CompletionAnswer(st, req, jobs))

    @router.post("/v1/chat/completions", openapi_extra=json_body(ChatReq))
    async def chat(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), ChatReq)
        check_model(st, req.model)
        job, tools = chat_job(req, st.tokenizer, st.info, st.tool_parser)
        return await _serve(request, st, [job], req.stream, ChatAnswer(st, req, [job], tools))

    return router


def check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model not in (st.model_name, st.info.model, st.info.model_path):
        raise ApiError(404, f"the model {model!r} does not exist (serving {st.model_name!r})",
                       "model")


async def _serve(
    request: Request,
    st: ServerState,
    jobs: list[Job],
    stream: bool,
    api: CompletionAnswer | ChatAnswer,
) -> Response:
    streams = await submit_all(st.bridge, jobs)
    book = SampleBook(jobs)
    if stream:
        return StreamingResponse(stream_events(streams, book, api),
                                 media_type="text/event-stream")
    try:
        await until_disconnected(request, collect(streams, book))
    except ClientGone:
        return Response(status_code=499)
    return json_response(api.response(book))


class StreamApi(Protocol):
    """What a streamed response says before, per new output of a sample, and after."""

    def opening(self, book: SampleBook) -> list[bytes]: ...

    def chunk(self, book: SampleBook, k: int, new: list[StepOutput]) -> bytes | None: ...

    def closing(self, book: SampleBook) -> bytes | None: ...


async def stream_events(
    streams: list[RequestStream], book: SampleBook, api: StreamApi
) -> AsyncIterator[bytes]:
    try:
        for opening in api.opening(book):
            yield opening
        async for outs in keepalive(merged(streams)):
            if outs is None:
                yield KEEPALIVE
                continue
            for k, new in book.absorb(outs).items():
                chunk = api.chunk(book, k, new)
                if chunk is not None:
                    yield chunk
        closing = api.closing(book)
        if closing is not None:
            yield closing
    except EngineDeadError as err:
        yield sse_event(error_body(503, str(err)))
    yield b"data: [DONE]\n\n"


