"""Front-end side of the engine process: start it, feed it, route its outputs to asyncio.

Threads: a sender thread packs queued messages into one pickle per wake-up (so a burst of
requests costs one pipe write and the event loop never blocks on a full pipe); a reader
thread receives ``StepBatch``/``Reply`` messages and hands each one to the event loop with a
single ``call_soon_threadsafe``. Only the event-loop thread touches the request registry.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar, cast

from tlt_serve.backends import entry_point
from tlt_serve.config import EngineConfig
from tlt_serve.contract.controls import Control, ControlOp, Crashed, Refused, Reply
from tlt_serve.contract.messages import (
    Abort,
    AbortAll,
    AddRequest,
    Failed,
    Fatal,
    FromEngine,
    Ready,
    Shutdown,
    StepBatch,
    ToEngine,
)
from tlt_serve.contract.reports import EngineInfo, StatsSnapshot
from tlt_serve.engine.engine import sample_rids
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.sampling_params import ParamError, SamplingParams
from tlt_serve.server.common.streams import RequestStream, StreamState

log = logging.getLogger("tlt_serve.bridge")
R = TypeVar("R")


class EngineStartError(RuntimeError):
    """The engine process failed to come up; the message says why."""


class EngineDeadError(RuntimeError):
    """The engine process is gone (or shutting down): nothing can be served."""


class RequestRejected(Exception):
    """The engine refused a request: kind "param" (bad input) or "overflow" (queue full)."""

    def __init__(self, kind: str, param: str | None, message: str) -> None:
        super().__init__(message)
        self.kind, self.param, self.message = kind, param, message


class ControlRefused(Exception):
    """The engine refused a control and changed nothing (a 4xx naming ``refused.field``)."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(refused.message)
        self.refused = refused


class ControlCrashed(Exception):
    """A control's handler failed in the engine process (a 500; the traceback is logged
    there)."""


class Bridge:
    def __init__(
        self,
        config: EngineConfig,
        log_level: str = "info",
        request_timeout_s: float | None = None,
    ) -> None:
        self.config = config
        self.log_level = log_level
        self.request_timeout_s = request_timeout_s  # abort requests older than this
        self.info: EngineInfo | None = None
        self.stats: StatsSnapshot | None = None  # latest snapshot pushed by the engine
        self.dead_reason: str | None = None
        self.closing = False
        self._stopped = False
        self._proc: Any = None  # a spawn-context Process
        self._conn: Connection | None = None
        self._outbox: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, StreamState] = {}  # front-end rid → state
        self._subs: dict[str, StreamState] = {}  # engine rid (rid or rid#i) → state
        self._calls: dict[int, asyncio.Future[Reply]] = {}
        self._call_ids = itertools.count()
        self._threads: list[threading.Thread] = []
        # Called with the new in-flight count whenever it changes (event-loop thread).
        self.load_listeners: list[Callable[[int], None]] = []

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: float = 900.0) -> EngineInfo:
        """Spawn the engine process and block until it has loaded the model."""
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe(duplex=True)
        backend = self.config.backend
        # vLLM's engine process starts processes of its own, which a daemon may not.
        self._proc = ctx.Process(
            target=entry_point(backend), args=(self.config, child, self.log_level),
            name=f"tlt-engine-{backend}", daemon=backend == "native",
        )
        self._proc.start()
        child.close()  # keep only the child's copy, so its exit gives us EOF
        self._conn = conn
        msg = self._wait_ready(timeout)
        if isinstance(msg, Failed):
            self._proc.join(5)
            raise EngineStartError(f"engine failed to start: {msg.message}")
        self.info = msg.info
        self._threads = [
            threading.Thread(target=self._read_loop, name="tlt-engine-reader", daemon=True),
            threading.Thread(target=self._send_loop, name="tlt-engine-sender", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return msg.info

    def _wait_ready(self, timeout: float) -> Ready | Failed:
        assert self._conn is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self._conn.poll(0.5):
                    msg = self._conn.recv()
                    if isinstance(msg, Ready | Failed):
                        return msg
                    log.error("unexpected first message from the engine: %r", msg)
                    break
            except EOFError:
                break
            if not self._proc.is_alive():
                break
        self._proc.kill()
        self._proc.join(5)
        code = self._proc.exitcode
        raise EngineStartError(f"engine process exited (code {code}) or timed out before ready")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything (callers get partial outputs), stop the process, join threads."""
        self.closing = True
        if self._proc is None or self._stopped:
            return
        self._stopped = True
        if self._proc.is_alive():
            self._outbox.put(Shutdown())
            self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("engine process did not stop in %.0fs; terminating", timeout)
            self._proc.terminate()
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._outbox.put(None)
        for t in self._threads:
            t.join(5)
        if self._conn is not None:
            self._conn.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this client serves (bound by the first request or call)."""
        return self._loop

    @property
    def weight_version(self) -> str:
        """The newest version the engine reported (stats ride on every control reply)."""
        if self.stats is not None:
            return self.stats.weight_version
        return self.info.weight_version if self.info is not None else ""

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._proc is not None and self._proc.is_alive()

    def check_alive(self) -> None:
        if self.closing:
            raise EngineDeadError("server is shutting down")
        if not self.alive:
            raise EngineDeadError(f"engine process is not running: {self.dead_reason or 'exited'}")

    # ---- requests ----------------------------------------------------------------------
    async def submit(
        self, rid: str, prompt_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it.

        Raises ParamError (duplicate rid), RequestRejected (engine refused), EngineDeadError.
        """
        self.check_alive()
        if rid in self._streams:
            raise ParamError("rid", f"request id {rid!r} is already in flight")
        loop = self._bind_loop()
        subs = tuple(sample_rids(rid, params.n))
        state = StreamState(rid, subs, loop)
        self._streams[rid] = state
        self._subs.update({s: state for s in subs})
        self._load_changed()
        self._outbox.put(AddRequest(rid, list(prompt_ids), params))
        try:
            await state.accepted
        except RequestRejected:
            raise  # the engine never queued it (and already forgot it)
        except BaseException:
            # Cancelled (client gone) or engine dead: the engine may have queued it already.
            self.abandon(state)
            raise
        if self.request_timeout_s is not None and state.remaining > 0:
            state.timer = loop.call_later(self.request_timeout_s, self.abort, rid)
        return RequestStream(state, self.abandon)

    async def generate(
        self, rid: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Every StepOutput of the request (all samples, interleaved) until all finish."""
        stream = await self.submit(rid, prompt_ids, params)
        try:
            async for outs in stream:
                for out in outs:
                    yield out
        finally:
            stream.close()

    def abort(self, rid: str) -> None:
        """Ask the engine to finish ``rid`` now; its caller still gets the partial output."""
        self._outbox.put(Abort(rid))

    def abort_all(self) -> None:
        self._outbox.put(AbortAll())

    def abandon(self, state: StreamState) -> None:
        """The caller went away: free the engine's KV and drop whatever is still in flight."""
        if state.remaining > 0 and self._streams.get(state.rid) is state:
            state.abandoned = True
            self.abort(state.rid)
        else:
            self._forget(state)

    def in_flight(self) -> int:
        """Front-end requests still streaming."""
        return len(self._streams)

    def _load_changed(self) -> None:
        for listener in self.load_listeners:
            listener(len(self._streams))

    def _forget(self, state: StreamState) -> None:
        if state.timer is not None:
            state.timer.cancel()
        if self._streams.get(state.rid) is state:
            del self._streams[state.rid]
            self._load_changed()
        for sub in state.subs:
            if self._subs.get(sub) is state:
                del self._subs[sub]

    # ---- control RPCs ------------------------------------------------------------------
    async def call(self, op: ControlOp[R], timeout: float | None = None) -> R:
        """Apply a control between two engine steps and return its reply; raises
        ControlRefused (nothing changed) or ControlCrashed (the handler failed)."""
        self.check_alive()
        loop = self._bind_loop()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Reply] = loop.create_future()
        self._calls[call_id] = fut
        self._outbox.put(Control(call_id, op))
        try:
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        result = reply.result
        if isinstance(result, Refused):
            raise ControlRefused(result)
        if isinstance(result, Crashed):
            raise ControlCrashed(result.message)
        return cast(R, result)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("Bridge is bound to another event loop")
        return loop

    # ---- threads -----------------------------------------------------------------------
    def _send_loop(self) -> None:
        assert self._conn is not None
        while True:
            batch = [self._outbox.get()]
            while True:  # coalesce everything queued meanwhile into one pickle
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            msgs = [m for m in batch if m is not None]
            if msgs:
                try:
                    self._conn.send(msgs)
                except OSError as err:
                    self._mark_dead(f"pipe to engine broke: {err}")
                    return
            if len(msgs) < len(batch):
                return

    def _read_loop(self) -> None:
        assert self._conn is not None
        while True:
            try:
                msg: FromEngine = self._conn.recv()
            except (EOFError, OSError):
                code = self._proc.exitcode if self._proc is not None else None
                self._mark_dead(f"engine process exited (code {code})")
                return
            if isinstance(msg, StepBatch) and msg.stats is not None:
                self.stats = msg.stats
            if isinstance(msg, Fatal):
                log.error("engine crashed:\n%s", msg.message)
                self._mark_dead("engine crashed: " + msg.message.strip().splitlines()[-1])
                continue
            self._post(self._on_message, msg)

    def _post(self, fn: Any, arg: Any) -> None:
        loop = self._loop
        if loop is None:
            return  # nobody has asked anything yet: there is nothing to deliver to
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            log.debug("event loop closed; dropping an engine message")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            if not self.closing:
                log.error("%s", reason)
            self._post(self._fail_all, EngineDeadError(reason))  # once, not per EOF/Fatal

    # ---- event-loop side -----------------------------------------------------------------
    def _on_message(self, msg: FromEngine) -> None:
        if isinstance(msg, Reply):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, StepBatch):
            self._on_batch(msg)

    def _on_batch(self, batch: StepBatch) -> None:
        for rid in batch.accepted:
            state = self._streams.get(rid)
            if state is not None and not state.accepted.done():
                state.accepted.set_result(None)
        for rej in batch.rejected:
            state = self._streams.get(rej.rid)
            if state is not None:
                self._forget(state)
                if not state.accepted.done():
                    state.accepted.set_exception(RequestRejected(rej.kind, rej.param, rej.message))
        for out in batch.outputs:
            state = self._subs.get(out.rid)
            if state is None:
                continue  # its caller left and aborted it
            state.push(out)
            if out.finished:
                del self._subs[out.rid]
                if state.remaining == 0:
                    self._forget(state)

    def _fail_all(self, err: EngineDeadError) -> None:
        for state in list(self._streams.values()):
            self._forget(state)
            if not state.accepted.done():
                state.accepted.set_exception(err)
            state.fail(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
