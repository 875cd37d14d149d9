"""The engine process's side of the pipe, one shape for every backend's loop.

A loop writes what it produced into the ``Outbox`` (request outputs, acknowledgements and
rejections of new requests) and flushes it as one ``StepBatch`` per step or tick, with a stats
snapshot at most every ``STATS_EVERY_S`` (or forced: the settled counters once idle, and
before every control reply, so the front end sees the state a control left before its
answer). A control's handler runs through ``outcome``: its reply type, or ``Refused`` for a
``ControlError`` / ``ParamError`` (nothing changed; the route answers 4xx naming the field),
or ``Crashed`` for anything else (a bug: logged with its traceback here, a 500 there; the
engine and its requests go on).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tlt_serve.contract.controls import ControlError, Crashed, Refused, Reply
from tlt_serve.contract.messages import Fatal, Rejected, StepBatch
from tlt_serve.contract.reports import StatsSnapshot
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.sampling_params import ParamError

log = logging.getLogger("tlt_serve.engine_process")
STATS_EVERY_S = 0.5  # a stats snapshot rides on a step batch at most this often


class Outbox:
    def __init__(
        self, conn: Any, snapshot: Callable[[], StatsSnapshot], version: Callable[[], str]
    ) -> None:
        self.conn = conn
        self.snapshot = snapshot  # the engine's stats now
        self.version = version  # the weight version served now (for refusals)
        self.outputs: list[StepOutput] = []
        self.accepted: list[str] = []  # front-end rids now queued
        self.rejected: list[Rejected] = []
        self.last_stats = 0.0
        self.closed = False  # the front end went away: the loop should stop

    def accept(self, rid: str) -> None:
        self.accepted.append(rid)

    def reject(self, rid: str, kind: str, param: str | None, message: str) -> None:
        self.rejected.append(Rejected(rid, kind, param, message))

    def flush(self, force_stats: bool = False) -> None:
        """Send what is pending as one StepBatch (nothing when there is nothing)."""
        now = time.monotonic()
        stats = None
        if force_stats or now - self.last_stats >= STATS_EVERY_S:
            stats, self.last_stats = self.snapshot(), now
        if not (self.outputs or self.accepted or self.rejected or stats):
            return
        batch = StepBatch(self.outputs, self.accepted, self.rejected, stats)
        self.outputs, self.accepted, self.rejected = [], [], []
        self._send(batch)

    def reply(self, call_id: int, result: Any) -> None:
        """A control's answer, after everything it produced and the state it left."""
        self.flush(force_stats=True)
        self._send(Reply(call_id, result))

    def fatal(self, message: str) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(Fatal(message))

    def outcome(self, name: str, run: Callable[[], Any]) -> Any:
        """``run()``'s result, or the Refused / Crashed reply its exception makes."""
        try:
            return run()
        except Exception as err:  # noqa: BLE001 - every failure becomes a reply
            return self.failure(name, err)

    async def outcome_async(self, name: str, run: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await run()
        except Exception as err:  # noqa: BLE001 - every failure becomes a reply
            return self.failure(name, err)

    def failure(self, name: str, err: Exception) -> Refused | Crashed:
        if isinstance(err, ControlError | ParamError):
            return Refused(str(err), err.field, self.version())
        log.error("control %s failed", name, exc_info=err)
        return Crashed(f"{name}: {type(err).__name__}: {err}")

    def _send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            self.closed = True
