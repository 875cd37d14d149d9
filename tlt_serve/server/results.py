"""Running jobs through the bridge and accumulating their samples (shared by all APIs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from tlt_serve.engine.engine import sample_rids
from tlt_serve.engine.outputs import RequestResult, StepOutput
from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.server.bridge import EngineClient
from tlt_serve.server.inputs import Job
from tlt_serve.server.streams import RequestStream

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
SSE_KEEPALIVE_S = 15.0  # a stream silent this long (e.g. queued) gets an SSE comment
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic
# Line breaks to str.splitlines (which httpx's iter_lines and other SSE readers use) that
# JSON leaves unescaped: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR, as their UTF-8 bytes.
_SPLITLINES_BREAKS = (
    (b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029")
)


def sse_event(payload: bytes) -> bytes:
    """One SSE ``data:`` event of a JSON payload, on one line for every reader: generated
    text may hold U+0085 / U+2028 / U+2029, which JSON keeps raw but line readers split at
    (an event cut in two is unparseable); escaped, the JSON means the same."""
    for raw, escaped in _SPLITLINES_BREAKS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return b"data: " + payload + b"\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected; its requests have been aborted."""


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


async def submit_all(client: EngineClient, jobs: list[Job]) -> list[RequestStream]:
    """Submit every job or none: if one is refused, the ones already queued are aborted.

    All jobs are sent before any acknowledgement is awaited: acks come between engine steps,
    so awaiting them one by one would cost a step per prompt of a batch.
    """
    tasks = [
        asyncio.ensure_future(client.submit(job.rid, job.prompt_ids, job.params)) for job in jobs
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
    """Await ``work``; if the client goes away first, cancel it (which aborts its requests)."""
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
    return [str(t) for t in tok.hf.batch_decode([[i] for i in ids])]
