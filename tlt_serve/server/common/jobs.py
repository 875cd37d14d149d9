"""A request's jobs, shared by every dialect: one ``Job`` per prompt (validated up front,
every error naming its field in the caller's vocabulary), run through the bridge, their
samples collected (JSON or SSE, bridge disconnects handled)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from tlt_serve.contract.reports import EngineInfo
from tlt_serve.engine.engine import sample_rids
from tlt_serve.engine.outputs import RequestResult, StepOutput
from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.sampling_params import ParamError, SamplingParams
from tlt_serve.server.common.bridge import Bridge
from tlt_serve.server.common.streams import RequestStream

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its bridge is there
SSE_KEEPALIVE_S = 15.0  # a stream silent this long (e.g. queued) gets an SSE comment
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic
# Line breaks to str.splitlines (which httpx's iter_lines and other SSE readers use) that
# JSON leaves unescaped: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR, as their UTF-8 bytes.
_SPLITLINES_BREAKS = (
    (b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029")
)


@dataclass(frozen=True)
class Job:
    """One prompt of a request, ready for ``Bridge.submit``."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams


def new_rid() -> str:
    return uuid.uuid4().hex


def check_prompt(ids: Sequence[int], info: EngineInfo, field: str) -> None:
    if not ids:
        raise ParamError(field, "prompt is empty")
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise ParamError(field, f"token id {bad} outside vocabulary [0, {info.vocab_size})")
    limit = info.max_model_len - 1  # at least one token of room for the output
    if len(ids) > limit:
        raise ParamError(
            field, f"prompt has {len(ids)} tokens, the limit is {limit} (max_model_len - 1)"
        )


def require_defaults(obj: Any, allowed: Mapping[str, tuple[Any, ...]], prefix: str = "") -> None:
    """Fields we accept only at no-op values: anything else is a 400, never ignored."""
    for name, values in allowed.items():
        value = getattr(obj, name)
        if not any(_same(value, v) for v in values):
            shown = ", ".join(repr(v) for v in values)
            raise ParamError(f"{prefix}{name}", f"not supported (accepted values: {shown})")


def _same(value: Any, allowed: Any) -> bool:
    # Types must match too: msgspec decodes each field to its declared type, and this keeps
    # True from passing for 1 (or 0 for False).
    return value is None if allowed is None else type(value) is type(allowed) and value == allowed


@contextmanager
def api_names(rename: Mapping[str, str]) -> Iterator[None]:
    """A ParamError raised inside renamed to the API's name for its field."""
    try:
        yield
    except ParamError as err:
        field = rename.get(err.field, err.field)
        raise ParamError(field, str(err).split(": ", 1)[1]) from err


def whole_vocab(k: int | None, info: EngineInfo) -> int | None:
    """vLLM's ``logprobs`` / ``prompt_logprobs`` of -1: every token of the vocabulary."""
    return info.vocab_size if k == -1 else k


def make_params(rename: Mapping[str, str], info: EngineInfo, **kwargs: Any) -> SamplingParams:
    """SamplingParams(**kwargs) for the served model, a ParamError renamed to the API's field
    name: top logprobs within the server's limit, a top-k at or above the vocabulary off."""
    with api_names(rename):
        params = SamplingParams(**kwargs)
        params.check_logprobs(info.logprob_limit)
    return params.for_vocab(info.vocab_size)


def sse_event(payload: bytes) -> bytes:
    """One SSE ``data:`` event of a JSON payload, on one line for every reader: generated
    text may hold U+0085 / U+2028 / U+2029, which JSON keeps raw but line readers split at
    (an event cut in two is unparseable); escaped, the JSON means the same."""
    for raw, escaped in _SPLITLINES_BREAKS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return b"data: " + payload + b"\n\n"


class ClientGone(Exception):
    """The HTTP bridge disconnected; its requests have been aborted."""


class SampleBook:
    """The samples of a response in API order: for each job (prompt), its n samples."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.samples: list[RequestResult] = []
        self.job_of: list[int] = []  # sample index → job index
        self._index: dict[str, int] = {}
        self.started = time.monotonic()
        for j, job in enumerate(jobs):
            n = job.params.n
            for sub in sample_rids(job.rid, n):
                self._index[sub] = len(self.samples)
                self.samples.append(RequestResult(sub, job.prompt_ids))
                self.job_of.append(j)

    def absorb(self, outs: list[StepOutput]) -> dict[int, list[StepOutput]]:
        """Add outputs to their samples; returns the new outputs per touched sample index."""
        touched: dict[int, list[StepOutput]] = {}
        for out in outs:
            k = self._index[out.rid]
            self.samples[k].add(out)
            touched.setdefault(k, []).append(out)
        return touched

    def job(self, k: int) -> Job:
        return self.jobs[self.job_of[k]]

    def elapsed(self) -> float:
        return time.monotonic() - self.started


async def submit_all(bridge: Bridge, jobs: list[Job]) -> list[RequestStream]:
    """Submit every job or none: if one is refused, the ones already queued are aborted.

    All jobs are sent before any acknowledgement is awaited: acks come between engine steps,
    so awaiting them one by one would cost a step per prompt of a batch.
    """
    tasks = [
        asyncio.ensure_future(bridge.submit(job.rid, job.prompt_ids, job.params)) for job in jobs
    ]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        close_all([s for s in done if isinstance(s, RequestStream)])
        raise
    streams = [r for r in results if isinstance(r, RequestStream)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        close_all(streams)
        raise errors[0]
    return streams


def close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


async def merged(streams: list[RequestStream]) -> AsyncGenerator[list[StepOutput], None]:
    """Output batches of several streams as they arrive; closes (aborts) them all at the end."""
    try:
        if len(streams) == 1:
            async for outs in streams[0]:
                yield outs
            return
        queue: asyncio.Queue[list[StepOutput] | Exception | None] = asyncio.Queue()

        async def pump(stream: RequestStream) -> None:
            try:
                async for outs in stream:
                    queue.put_nowait(outs)
            except Exception as err:  # forwarded to the consumer, which re-raises it
                queue.put_nowait(err)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(s)) for s in streams]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        close_all(streams)


async def keepalive(
    source: AsyncGenerator[list[StepOutput], None], every_s: float | None = None
) -> AsyncIterator[list[StepOutput] | None]:
    """The batches of ``source``, plus ``None`` whenever ``every_s`` (default
    ``SSE_KEEPALIVE_S``) pass without one: the stream then sends an SSE comment, so a request
    waiting in the queue keeps its connection alive through proxies with idle timeouts.
    Closing this closes ``source`` (which aborts its requests)."""
    every = SSE_KEEPALIVE_S if every_s is None else every_s
    it = aiter(source)
    pending: asyncio.Future[list[StepOutput]] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                outs = task.result()
            except StopAsyncIteration:
                return
            yield outs
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await source.aclose()


async def collect(streams: list[RequestStream], book: SampleBook) -> SampleBook:
    async for outs in merged(streams):
        book.absorb(outs)
    return book


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the bridge goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def token_texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    """Each token decoded on its own (what logprob entries show)."""
    if not ids:
        return []  # transformers decodes an empty batch as one empty text
    return [str(t) for t in tok.hf.batch_decode([[i] for i in ids])]
