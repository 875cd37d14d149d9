"""The native engine's process: owns the Engine and runs its loop, apart from the front end.

Running the engine in its own process keeps tokenization, JSON and socket work of the front
end from stealing the GIL between forwards. Each iteration: drain queued messages (blocking
only when there is nothing to step), apply them, run one ``engine.step()`` and send what it
produced as ONE ``StepBatch`` (pickling per token per request would cost more than the step).
Controls are applied between steps (``controls.py``), so weight swaps never race a forward.
"""

from __future__ import annotations

import logging
import signal
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tlt_serve.backends.common.descriptors import close_inherited_on_exec
from tlt_serve.backends.common.outbox import Outbox
from tlt_serve.backends.native.controls import (
    BACKGROUND_EXCLUSIVE,
    HANDLERS,
    Background,
    NativeControls,
)
from tlt_serve.config import EngineConfig
from tlt_serve.contract.controls import Control, ControlOp, GetInfo, GetStats, Refused
from tlt_serve.contract.messages import (
    Abort,
    AbortAll,
    AddRequest,
    Failed,
    Ready,
    Shutdown,
    ToEngine,
)
from tlt_serve.engine.engine import Engine
from tlt_serve.speculative.checkpoint import DrafterError
from tlt_serve.speculative.decoder import build_spec_decoder

log = logging.getLogger("tlt_serve.native")
IDLE_WAIT_S = 0.5  # how long to block for messages when there is nothing to step


def run_native(config: EngineConfig, conn: Connection, log_level: str = "info") -> None:
    """Process entry point (spawn target): build the engine, report ready, loop until told."""
    # Ctrl-C reaches the whole process group; the front end decides how to shut us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    close_inherited_on_exec()  # our exit must close the front end's pipe and sentinel
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        engine = Engine(config, build_spec_decoder)
    except DrafterError as err:  # a bad --drafter: the message says what, no traceback needed
        log.error("engine start-up failed: %s", err)
        conn.send(Failed(f"{type(err).__name__}: {err}"))
        return
    except Exception as err:  # any start-up failure must reach the parent, never hang it
        log.exception("engine start-up failed")
        conn.send(Failed(f"{type(err).__name__}: {err}"))
        return
    loop = NativeLoop(engine, conn)
    conn.send(Ready(loop.controls.info(GetInfo())))
    try:
        loop.run()
    except (EOFError, OSError):
        log.info("front end went away; engine process exiting")
    except Exception:
        log.exception("engine loop crashed")
        loop.outbox.fatal(traceback.format_exc())
        raise


@dataclass
class _Pending:
    """A background control in flight: its reply goes out when ``future`` is done."""

    call_id: int
    name: str
    future: Future[Any]
    finish: Callable[[Any], Any]


def _in_thread(work: Callable[[], Any]) -> Future[Any]:
    """Run ``work`` on a daemon thread (one blocked on a trainer never holds up exit)."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as err:  # delivered to the engine loop, which replies with it
            future.set_exception(err)

    threading.Thread(target=run, name="engine-background", daemon=True).start()
    return future


class NativeLoop:
    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.controls = NativeControls(engine, self._abort_all)
        self.outbox = Outbox(conn, lambda: self.controls.stats(GetStats()),
                             lambda: engine.weight_version)
        self.stopping = False
        self.stats_dirty = True
        self.pending: _Pending | None = None  # at most one background control at a time

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        outbox = self.outbox
        while not (self.stopping or outbox.closed):
            self._drain(0.0 if self._can_step() else IDLE_WAIT_S)
            self._reply_background()
            # Acks, rejections and abort outputs go out before the (possibly long) step.
            outbox.flush()
            if self.stopping:
                break
            if self._can_step():
                outbox.outputs.extend(self.engine.step())
                self.stats_dirty = True
                outbox.flush()
            elif self.stats_dirty:
                outbox.flush(force_stats=True)  # idle now: report the settled counters
                self.stats_dirty = False
        outbox.flush(force_stats=True)

    def _can_step(self) -> bool:
        self.controls.settle()
        return not self.controls.paused and self.engine.has_work()

    def _drain(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            return
        while True:
            msgs: list[ToEngine] = self.conn.recv()
            for msg in msgs:
                self._apply(msg)
            if self.stopping or not self.conn.poll():
                return

    # ---- messages ----------------------------------------------------------------------
    def _apply(self, msg: ToEngine) -> None:
        self.stats_dirty = True
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, Abort):
            self.outbox.outputs.extend(self.engine.abort(msg.rid))
        elif isinstance(msg, AbortAll):
            self._abort_all()
        elif isinstance(msg, Control):
            self._control(msg)
        elif isinstance(msg, Shutdown):
            self._abort_all()
            self.stopping = True

    def _add(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(msg.rid, msg.prompt_ids, msg.params)
        except OverflowError as err:
            self.outbox.reject(msg.rid, "overflow", None, str(err))
        except ValueError as err:  # ParamError names its field; others are still bad input
            self.outbox.reject(msg.rid, "param", getattr(err, "field", None), str(err))
        else:
            self.outbox.accept(msg.rid)

    def _control(self, msg: Control) -> None:
        op, name = msg.op, type(msg.op).__name__
        if self.pending is not None and isinstance(op, BACKGROUND_EXCLUSIVE):
            busy = f"busy: {self.pending.name} is still in progress"
            self.outbox.reply(msg.call_id, Refused(busy, None, self.engine.weight_version))
            return
        result = self.outbox.outcome(name, lambda: self._handle(op))
        if isinstance(result, Background):
            self.pending = _Pending(msg.call_id, name, _in_thread(result.work), result.finish)
            return  # it replies when its work is done
        # Outputs a control produced (pause abort) and the state it left (version, paused)
        # reach the front end before its reply.
        self.outbox.reply(msg.call_id, result)

    def _handle(self, op: ControlOp[Any]) -> Any:
        return HANDLERS[type(op)](self.controls, op)

    def _reply_background(self) -> None:
        """The background control's reply, once its work is done (finished on this thread,
        between two steps)."""
        pending = self.pending
        if pending is None or not pending.future.done():
            return
        self.pending = None
        result = self.outbox.outcome(
            pending.name, lambda: pending.finish(pending.future.result()))
        self.outbox.reply(pending.call_id, result)

    def _abort_all(self) -> None:
        self.outbox.outputs.extend(self.engine.abort_all())
