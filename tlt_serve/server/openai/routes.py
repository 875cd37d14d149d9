"""OpenAI-compatible ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from tlt_serve.engine.outputs import RequestResult, StepOutput
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
from tlt_serve.server.openai.format import (
    LogprobFormatter,
    finish_str,
    joined,
    latest_version,
    merge_delta,
    stop_reason,
    usage,
)
from tlt_serve.server.openai.inputs import chat_job, completion_jobs
from tlt_serve.server.openai.protocol import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatMessageOut,
    ChatReq,
    ChatResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionReq,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptLogprobsOut,
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
        return await _serve(request, st, jobs, req.stream, _Completions(st, req, jobs))

    @router.post("/v1/chat/completions", openapi_extra=json_body(ChatReq))
    async def chat(request: Request) -> Response:
        st = get_state(request)
        req = decode_body(await request.body(), ChatReq)
        check_model(st, req.model)
        jobs = [chat_job(req, st.tokenizer, st.info)]
        return await _serve(request, st, jobs, req.stream, _Chat(st, req, jobs))

    return router


def _prompt_texts(st: ServerState, req: CompletionReq, jobs: list[Job]) -> list[str]:
    """What an echo shows of each prompt: the text sent, or the token ids' decoding."""
    if isinstance(req.prompt, str):
        return [req.prompt]
    if all(isinstance(p, str) for p in req.prompt):
        return [str(p) for p in req.prompt]
    return [st.tokenizer.hf.decode(job.prompt_ids) for job in jobs]


def check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model not in (st.model_name, st.info.model, st.info.model_path):
        raise ApiError(404, f"the model {model!r} does not exist (serving {st.model_name!r})",
                       "model")


async def _serve(
    request: Request, st: ServerState, jobs: list[Job], stream: bool, api: _Completions | _Chat
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


def event(obj: object) -> bytes:
    return sse_event(msgspec.json.encode(obj))


class _Api:
    """Shared by both APIs: ids, timestamps, stream flags, logprob formatting."""

    def __init__(self, st: ServerState, prefix: str, jobs: list[Job], include_usage: bool,
                 req: CompletionReq | ChatReq) -> None:
        self.st = st
        self.id = f"{prefix}-{jobs[0].rid}"
        self.created = int(time.time())
        self.include_usage = include_usage
        self.token_ids = req.return_token_ids
        self.prompt_top = req.prompt_logprobs  # None: no prompt_logprobs field
        self.lp = LogprobFormatter(st.tokenizer, req.return_tokens_as_token_ids)
        self.eos = st.tokenizer.eos_ids
        self.text_offsets: dict[int, int] = {}

    def _usage_field(self) -> None | msgspec.UnsetType:
        return None if self.include_usage else msgspec.UNSET

    def _prompt_logprobs(self, r: RequestResult) -> PromptLogprobsOut | msgspec.UnsetType:
        if self.prompt_top is None or r.prompt_logprobs is None:
            return msgspec.UNSET
        return self.lp.prompt_logprobs(r.prompt_ids, r.prompt_logprobs, self.prompt_top)


class _Completions(_Api):
    def __init__(self, st: ServerState, req: CompletionReq, jobs: list[Job]) -> None:
        opts = req.stream_options
        super().__init__(st, "cmpl", jobs, bool(opts and opts.include_usage), req)
        self.started: set[int] = set()
        self.echo = req.echo
        self.prompt_texts = _prompt_texts(st, req, jobs) if req.echo else []

    def _logprobs(self, book: SampleBook, k: int, r: RequestResult,
                  offset: int) -> tuple[CompletionLogprobs | None, int]:
        """A choice's logprobs from ``offset`` on: an echoed prompt's first (when ``r``
        starts the choice), then its new tokens'."""
        params = book.job(k).params
        if not params.logprobs:
            return None, offset
        head = None
        if self.echo and r.prompt_logprobs is not None:
            head, offset = self.lp.echoed(r.prompt_ids, r.prompt_logprobs, params.top_logprobs)
        out, end = self.lp.completion(r.token_ids, r.logprobs, r.top_logprobs, offset)
        return (out if head is None else joined(head, out)), end

    def response(self, book: SampleBook) -> CompletionResponse:
        choices = []
        for k, r in enumerate(book.samples):
            params = book.job(k).params
            logprobs = self._logprobs(book, k, r, 0)[0]
            text = self.prompt_texts[book.job_of[k]] + r.text if self.echo else r.text
            choice = CompletionChoice(
                k, text, logprobs, finish_str(r.finish), stop_reason(r.finish, params, self.eos)
            )
            if self.token_ids:
                choice.token_ids, choice.prompt_token_ids = list(r.token_ids), list(r.prompt_ids)
            choice.prompt_logprobs = self._prompt_logprobs(r)
            choices.append(choice)
        return CompletionResponse(self.id, self.created, self.st.model_name, choices,
                                  latest_version(book), usage=usage(book))

    def opening(self, book: SampleBook) -> list[bytes]:
        return []

    def chunk(self, book: SampleBook, k: int, new: list[StepOutput]) -> bytes | None:
        d, params = merge_delta(new), book.job(k).params
        d.prompt_ids = book.samples[k].prompt_ids
        first = k not in self.started
        logprobs, self.text_offsets[k] = self._logprobs(book, k, d, self.text_offsets.get(k, 0))
        text = self.prompt_texts[book.job_of[k]] + d.text if self.echo and first else d.text
        choice = CompletionChoice(
            k, text, logprobs, finish_str(d.finish), stop_reason(d.finish, params, self.eos)
        )
        if self.token_ids:
            choice.token_ids = list(d.token_ids)
            if first:
                choice.prompt_token_ids = list(d.prompt_ids)
        choice.prompt_logprobs = self._prompt_logprobs(d)
        self.started.add(k)
        return event(CompletionResponse(self.id, self.created, self.st.model_name, [choice],
                                         d.weight_version, usage=self._usage_field()))

    def closing(self, book: SampleBook) -> bytes | None:
        if not self.include_usage:
            return None
        return event(CompletionResponse(self.id, self.created, self.st.model_name, [],
                                         latest_version(book), usage=usage(book)))


class _Chat(_Api):
    def __init__(self, st: ServerState, req: ChatReq, jobs: list[Job]) -> None:
        opts = req.stream_options
        super().__init__(st, "chatcmpl", jobs, bool(opts and opts.include_usage), req)

    def response(self, book: SampleBook) -> ChatResponse:
        choices = []
        for k, r in enumerate(book.samples):
            params = book.job(k).params
            logprobs = (
                self.lp.chat(r.token_ids, r.logprobs, r.top_logprobs) if params.logprobs else None
            )
            choice = ChatChoice(
                k, ChatMessageOut("assistant", r.text), logprobs, finish_str(r.finish),
                stop_reason(r.finish, params, self.eos),
            )
            if self.token_ids:
                choice.token_ids = list(r.token_ids)
            choices.append(choice)
        out = ChatResponse(self.id, self.created, self.st.model_name, choices,
                           latest_version(book), usage=usage(book))
        if self.token_ids:
            out.prompt_token_ids = list(book.jobs[0].prompt_ids)
        out.prompt_logprobs = self._prompt_logprobs(book.samples[0])
        return out

    def opening(self, book: SampleBook) -> list[bytes]:
        """The role announcement for every choice, before any content (as OpenAI does)."""
        chunks = []
        for k in range(len(book.samples)):
            choice = ChatChunkChoice(k, ChatDelta(role="assistant", content=""), None, None)
            chunk = ChatChunk(self.id, self.created, self.st.model_name, [choice],
                              self.st.bridge.weight_version, usage=self._usage_field())
            if self.token_ids and k == 0:
                chunk.prompt_token_ids = list(book.jobs[0].prompt_ids)
            chunks.append(event(chunk))
        return chunks

    def chunk(self, book: SampleBook, k: int, new: list[StepOutput]) -> bytes | None:
        d, params = merge_delta(new), book.job(k).params
        if not (d.text or d.finish or params.logprobs or self.token_ids):
            return None  # nothing a client could see (text held back mid-character)
        logprobs = None
        if params.logprobs:
            logprobs = self.lp.chat(d.token_ids, d.logprobs, d.top_logprobs)
        choice = ChatChunkChoice(
            k, ChatDelta(content=d.text), logprobs, finish_str(d.finish),
            stop_reason(d.finish, params, self.eos),
        )
        if self.token_ids:
            choice.token_ids = list(d.token_ids)
        d.prompt_ids = book.samples[k].prompt_ids
        out = ChatChunk(self.id, self.created, self.st.model_name, [choice], d.weight_version,
                        usage=self._usage_field())
        if k == 0:
            out.prompt_logprobs = self._prompt_logprobs(d)
        return event(out)

    def closing(self, book: SampleBook) -> bytes | None:
        if not self.include_usage:
            return None
        return event(ChatChunk(self.id, self.created, self.st.model_name, [],
                                latest_version(book), usage=usage(book)))
