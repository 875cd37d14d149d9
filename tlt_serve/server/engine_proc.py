"""The engine process: owns the Engine and runs its loop, apart from the HTTP front end.

Running the engine in its own process keeps tokenization, JSON and socket work of the front
end from stealing the GIL between forwards. Each iteration: drain queued messages (blocking
only when there is nothing to step), apply them, run one ``engine.step()`` and send what it
produced as ONE ``StepBatch`` (pickling per token per request would cost more than the step).
Control messages are applied between steps, so weight swaps never race a forward.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tlt_serve.config import EngineConfig
from tlt_serve.engine.engine import Engine
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.sampling_params import ParamError
from tlt_serve.server.engine_drafter import DrafterControls
from tlt_serve.server.engine_weights import Background, ControlError, WeightControls
from tlt_serve.server.messages import (
    Abort,
    AbortAll,
    AddRequest,
    Control,
    EngineInfo,
    Failed,
    Fatal,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    SpecInfo,
    StatsSnapshot,
    StepBatch,
    ToEngine,
    snapshot_of,
)
from tlt_serve.speculative.checkpoint import DrafterError

log = logging.getLogger("tlt_serve.engine_proc")
IDLE_WAIT_S = 0.5  # how long to block for messages when there is nothing to step
# Controls refused while a background one (which holds the weight-sync group) is in flight.
BACKGROUND_EXCLUSIVE = frozenset({
    "init_weights_update_group", "update_weights_from_distributed",
    "destroy_weights_update_group",
})
STATS_EVERY_S = 0.5  # attach a stats snapshot to step batches at most this often
PAUSE_MODES = ("abort", "in_place")


def run_engine(config: EngineConfig, conn: Connection, log_level: str = "info") -> None:
    """Process entry point (spawn target): build the engine, report ready, loop until told."""
    # Ctrl-C reaches the whole process group; the front end decides how to shut us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        engine = Engine(config)
    except DrafterError as err:  # a bad --drafter: the message says what, no traceback needed
        log.error("engine start-up failed: %s", err)
        conn.send(Failed(f"{type(err).__name__}: {err}"))
        return
    except Exception as err:  # any start-up failure must reach the parent, never hang it
        log.exception("engine start-up failed")
        conn.send(Failed(f"{type(err).__name__}: {err}"))
        return
    loop = EngineLoop(engine, conn)
    conn.send(Ready(loop.info()))
    try:
        loop.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("front end went away; engine process exiting")
    except Exception:
        log.exception("engine loop crashed")
        _send_quietly(conn, Fatal(traceback.format_exc()))
        raise


def _send_quietly(conn: Connection, msg: Any) -> None:
    try:
        conn.send(msg)
    except OSError:
        log.warning("could not report to the front end")


@dataclass
class _Pending:
    """A background control in flight: its reply goes out when ``future`` is done."""

    call_id: int
    name: str
    future: Future[Any]
    finish: Callable[[Any], dict[str, Any]]


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


class EngineLoop:
    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.paused = False
        self.stopping = False
        self.outputs: list[StepOutput] = []
        self.accepted: list[str] = []
        self.rejected: list[Rejected] = []
        self.last_stats = 0.0
        self.stats_dirty = True
        self.pending: _Pending | None = None  # at most one background control at a time
        self.controls: dict[str, Callable[..., dict[str, Any] | Background]] = {
            "info": lambda: {"info": self.info()},
            "stats": lambda: {"stats": self.snapshot()},
            "pause": self._pause,
            "continue": self._continue,
            "flush_cache": self._flush_cache,
            **WeightControls(engine, self._abort_all).handlers(),
            **DrafterControls(engine).handlers(),
        }

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            self._drain(0.0 if self._can_step() else IDLE_WAIT_S)
            self._reply_background()
            # Acks, rejections and abort outputs go out before the (possibly long) step.
            self._flush()
            if self.stopping:
                break
            if self._can_step():
                self.outputs.extend(self.engine.step())
                self.stats_dirty = True
                self._flush()
            elif self.stats_dirty:
                self._flush(force_stats=True)  # idle now: report the settled counters
        self._flush(force_stats=True)

    def _can_step(self) -> bool:
        return not self.paused and self.engine.has_work()

    def _drain(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            return
        while True:
            msgs: list[ToEngine] = self.conn.recv()
            for msg in msgs:
                self._apply(msg)
            if self.stopping or not self.conn.poll():
                return

    def _flush(self, force_stats: bool = False) -> None:
        now = time.monotonic()
        stats = None
        if force_stats or now - self.last_stats >= STATS_EVERY_S:
            stats, self.last_stats, self.stats_dirty = self.snapshot(), now, False
        if not (self.outputs or self.accepted or self.rejected or stats):
            return
        self.conn.send(StepBatch(self.outputs, self.accepted, self.rejected, stats))
        self.outputs, self.accepted, self.rejected = [], [], []

    # ---- messages ----------------------------------------------------------------------
    def _apply(self, msg: ToEngine) -> None:
        self.stats_dirty = True
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, Abort):
            self.outputs.extend(self.engine.abort(msg.rid))
        elif isinstance(msg, AbortAll):
            self.outputs.extend(self.engine.abort_all())
        elif isinstance(msg, Control):
            reply = self._control(msg)
            if reply is None:
                return  # a background control: it replies when its work is done
            # Outputs a control produced (pause abort) and the state it left (version,
            # paused) reach the front end before its reply.
            self._flush(force_stats=True)
            self.conn.send(reply)
        elif isinstance(msg, Shutdown):
            self.outputs.extend(self.engine.abort_all())
            self.stopping = True

    def _add(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(msg.rid, msg.prompt_ids, msg.params)
        except OverflowError as err:
            self.rejected.append(Rejected(msg.rid, "overflow", None, str(err)))
        except ValueError as err:  # ParamError names its field; others are still bad input
            field = getattr(err, "field", None)
            self.rejected.append(Rejected(msg.rid, "param", field, str(err)))
        else:
            self.accepted.append(msg.rid)

    def _control(self, msg: Control) -> Reply | None:
        handler = self.controls.get(msg.name)
        if handler is None:
            return self._fail(msg.call_id, f"unknown control {msg.name!r}")
        if self.pending is not None and msg.name in BACKGROUND_EXCLUSIVE:
            return self._fail(msg.call_id, f"busy: {self.pending.name} is still in progress")
        return self._guarded(msg.call_id, msg.name, lambda: handler(**msg.kwargs))

    def _guarded(
        self, call_id: int, name: str, run: Callable[[], dict[str, Any] | Background]
    ) -> Reply | None:
        try:
            payload = run()
        except (ControlError, ParamError) as err:
            return self._fail(call_id, str(err))
        except Exception as err:  # a failed RPC must not take the engine (and its requests) down
            log.exception("control %s failed", name)
            return self._fail(call_id, f"{type(err).__name__}: {err}")
        if isinstance(payload, Background):
            self.pending = _Pending(call_id, name, _in_thread(payload.work), payload.finish)
            return None
        return Reply(call_id, True, payload)

    def _reply_background(self) -> None:
        """The background control's reply, once its work is done (finished on this thread,
        between two steps)."""
        pending = self.pending
        if pending is None or not pending.future.done():
            return
        self.pending = None
        reply = self._guarded(
            pending.call_id, pending.name, lambda: pending.finish(pending.future.result())
        )
        assert reply is not None
        self._flush(force_stats=True)
        self.conn.send(reply)

    def _abort_all(self) -> None:
        self.outputs.extend(self.engine.abort_all())

    def _fail(self, call_id: int, message: str) -> Reply:
        return Reply(call_id, False, {"message": message, "weight_version": self.version})

    # ---- control handlers ----------------------------------------------------------------
    @property
    def version(self) -> str:
        return self.engine.weight_version

    def _pause(self, mode: str = "abort") -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ControlError(f"mode: must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":
            self.outputs.extend(self.engine.abort_all())
        self.paused = True
        return {"paused": True, "mode": mode}

    def _continue(self) -> dict[str, Any]:
        self.paused = False
        return {"paused": False}

    def _flush_cache(self) -> dict[str, Any]:
        sched = self.engine.scheduler
        busy = len(sched.running) + len(sched.waiting)
        if busy:
            raise ControlError(f"cache not flushed: {busy} requests are running or waiting")
        return {}

    # ---- reports -----------------------------------------------------------------------
    def info(self) -> EngineInfo:
        cfg, spec = self.engine.config, self.engine.spec
        return EngineInfo(
            model=cfg.model.model,
            model_path=str(self.engine.model_path),
            dtype=cfg.model.dtype,
            vocab_size=self.engine.vocab_size,
            max_model_len=cfg.model.max_model_len,
            max_num_seqs=cfg.cache.max_num_seqs,
            max_waiting=cfg.scheduler.max_waiting,
            eos_ids=tuple(sorted(self.engine.tokenizer.eos_ids)),
            weight_version=self.version,
            spec=SpecInfo(
                method=spec.config.method,
                proposer=spec.proposer_name,
                num_draft_tokens=spec.config.num_draft_tokens,
                max_batch=spec.config.max_batch,
                drafter=spec.config.drafter,
                strategies=tuple(str(a) for a in spec.policy.arms),
            ),
        )

    def snapshot(self) -> StatsSnapshot:
        sched = self.engine.scheduler
        return snapshot_of(
            self.engine.stats,
            running=len(sched.running),
            waiting=len(sched.waiting),
            max_num_seqs=self.engine.config.cache.max_num_seqs,
            weight_version=self.version,
            paused=self.paused,
            drafter_version=self.engine.spec.drafter_version,
            capture=self.engine.capture.stats(),
            spec_policy=self.engine.spec.policy.table(),
            kv_tokens=sum(r.num_tokens for r in sched.running),
        )

