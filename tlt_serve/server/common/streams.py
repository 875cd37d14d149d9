"""Per-request output streams on the event loop (filled by the bridge, read by the routes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tlt_serve.engine.outputs import StepOutput


class StreamState:
    """Outputs of one front-end request (all of its samples), in arrival order.

    A list plus one waiter future is lighter than an asyncio.Queue and lets the reader take
    everything that piled up in one go (a slow client then gets fewer, larger events).
    """

    def __init__(self, rid: str, subs: tuple[str, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.rid = rid
        self.subs = subs  # engine ids: (rid,) or (rid#0, rid#1, ...)
        self.loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.remaining = len(subs)  # samples without a final output yet
        self.items: list[StepOutput] = []
        self.error: BaseException | None = None
        # The caller left: outputs are dropped, but the rid stays registered (and so cannot
        # be reused) until the engine reports its samples finished.
        self.abandoned = False
        self.timer: asyncio.TimerHandle | None = None  # the request timeout's abort
        self._waiter: asyncio.Future[None] | None = None

    def push(self, out: StepOutput) -> None:
        if out.finished:
            self.remaining -= 1
        if not self.abandoned:
            self.items.append(out)
            self._wake()

    def fail(self, err: BaseException) -> None:
        self.error = err
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[StepOutput]:
        """Everything available (at least one output), or raise the stream's error."""
        while not self.items:
            if self.error is not None:
                raise self.error
            self._waiter = self.loop.create_future()
            await self._waiter
        items, self.items = self.items, []
        return items

    @property
    def done(self) -> bool:
        return self.remaining == 0 and not self.items


class RequestStream:
    """Async iterator of output batches; ``close()`` aborts the request if it is unfinished."""

    def __init__(self, state: StreamState, on_abandon: Callable[[StreamState], None]) -> None:
        self.state = state
        self._on_abandon = on_abandon
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[StepOutput]:
        if self.state.done:
            self._closed = True
            raise StopAsyncIteration
        return await self.state.take()

    def close(self) -> None:
        """Idempotent. Called from ``finally`` blocks, including on cancellation."""
        if self._closed:
            return
        self._closed = True
        if self.state.remaining > 0 and self.state.error is None:
            self._on_abandon(self.state)
