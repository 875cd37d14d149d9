"""The vLLM engine process's loop: the front end's messages in, ``StepBatch``es out.

vLLM runs its own scheduler (in its engine-core process) and streams each request's tokens
to an asyncio queue in this process; this loop is an asyncio program around it:

- a reader thread hands the front end's message lists to the loop;
- ``AddRequest``: each of the n samples becomes one vLLM request (``convert.py``) whose DELTA
  outputs a task turns into ``StepOutput``s; they leave in one ``StepBatch`` per flush
  (every ``FLUSH_S``, as the native loop sends one per step);
- ``Abort`` / ``AbortAll``: vLLM ends the streams at once with finish ``abort`` (the partial
  tokens were already streamed);
- ``Control``: each runs as a task (requests keep flowing meanwhile); those that change
  weights take turns on one lock; a control's outputs (pause abort) go out before its reply;
- the engine core dying ends every request stream with ``EngineDeadError``: the loop reports
  ``Fatal`` and exits, and the front end answers 503 from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlt_serve.backends.vllm.convert import SampleState, check_params, step_output, vllm_params
from tlt_serve.backends.vllm.stats import LoopStats
from tlt_serve.engine.engine import sample_rids
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.sampling_params import ParamError
from tlt_serve.server.engine_weights import ControlError
from tlt_serve.server.messages import (
    Abort,
    AbortAll,
    AddRequest,
    Control,
    EngineInfo,
    Fatal,
    Rejected,
    Reply,
    Shutdown,
    StepBatch,
)

if TYPE_CHECKING:
    from tlt_serve.backends.vllm.capture import VllmCapture

log = logging.getLogger("tlt_serve.vllm")
RPC_TIMEOUT_S = 600.0  # vLLM does not fail a pending collective_rpc when its engine dies
FLUSH_S = 0.005  # outputs gathered this long go out as one StepBatch
STATS_EVERY_S = 0.5

Handler = Callable[..., Awaitable[dict[str, Any]]]


class VllmLoop:
    def __init__(
        self, llm: Any, conn: Any, info: EngineInfo, stats: LoopStats, scratch: Path
    ) -> None:
        self.llm = llm
        self.conn = conn
        self.scratch = scratch  # files exchanged with vLLM's worker
        self.capture: VllmCapture | None = None
        self.info = info
        self.stats = stats
        self.version = info.weight_version
        self.drafter_version: int | None = None  # the drafter serving (speculating with one)
        self.paused = False
        self.stopping = False
        self.dead: str | None = None
        self.samples: dict[str, list[str]] = {}  # front-end rid → its live sample rids
        self.tasks: dict[str, asyncio.Task[None]] = {}  # sample rid → its stream task
        self.outputs: list[StepOutput] = []
        self.accepted: list[str] = []
        self.rejected: list[Rejected] = []
        self.last_stats = 0.0
        self.weights_lock = asyncio.Lock()  # one weight / drafter change at a time
        self.controls: dict[str, Handler] = {}  # filled by the control modules
        self.inbox: asyncio.Queue[list[Any] | None] = asyncio.Queue()

    # ---- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(loop,), name="vllm-reader", daemon=True).start()
        flusher = asyncio.create_task(self._flush_forever())
        try:
            while not self.stopping and self.dead is None:
                msgs = await self.inbox.get()
                if msgs is None:  # the front end went away
                    break
                for msg in msgs:
                    await self._apply(msg)
        finally:
            await self.abort_every_sample()
            await self._drain_tasks(5.0)
            flusher.cancel()
            self._flush(force_stats=True)

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                msgs = self.conn.recv()
                loop.call_soon_threadsafe(self.inbox.put_nowait, msgs)
        except (EOFError, OSError):
            loop.call_soon_threadsafe(self.inbox.put_nowait, None)

    async def _flush_forever(self) -> None:
        checked = time.monotonic()
        while True:
            await asyncio.sleep(FLUSH_S)
            self._flush()
            if time.monotonic() - checked > STATS_EVERY_S:  # idle, vLLM tells nobody
                checked = time.monotonic()
                if self.llm.errored:
                    self._die("vLLM engine core died")

    def _flush(self, force_stats: bool = False) -> None:
        now = time.monotonic()
        snapshot = None
        if force_stats or now - self.last_stats >= STATS_EVERY_S:
            snapshot, self.last_stats = self.stats.snapshot(self), now
        if not (self.outputs or self.accepted or self.rejected or snapshot):
            return
        batch = StepBatch(self.outputs, self.accepted, self.rejected, snapshot)
        self.outputs, self.accepted, self.rejected = [], [], []
        try:
            self.conn.send(batch)
        except OSError:
            self.stopping = True

    # ---- messages ----------------------------------------------------------------------
    async def _apply(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            await self._add(msg)
        elif isinstance(msg, Abort):
            await self._abort(self.samples.get(msg.rid, []))
        elif isinstance(msg, AbortAll):
            await self.abort_every_sample()
        elif isinstance(msg, Control):
            asyncio.create_task(self._control(msg))
        elif isinstance(msg, Shutdown):
            self.stopping = True

    async def _add(self, msg: AddRequest) -> None:
        params = msg.params
        try:
            check_params(params, speculating=self.info.spec.enabled)
            live = sum(len(s) for s in self.samples.values())
            limit = self.info.max_num_seqs + self.info.max_waiting
            if live + params.n > limit:
                raise OverflowError(f"queue full: {live} sequences in flight, limit {limit}")
        except OverflowError as err:
            self.rejected.append(Rejected(msg.rid, "overflow", None, str(err)))
            return
        except ParamError as err:
            self.rejected.append(Rejected(msg.rid, "param", err.field, str(err)))
            return
        # As natively, an output past the context stops there with finish "length".
        max_tokens = min(params.max_new_tokens, self.info.max_model_len - len(msg.prompt_ids))
        subs = sample_rids(msg.rid, params.n)
        collectors = []
        try:
            for i, sub in enumerate(subs):
                collectors.append(await self.llm.add_request(
                    sub, self._prompt(msg.prompt_ids), vllm_params(params, i, max_tokens)))
        except Exception as err:  # vLLM refused it: nothing of it may stay queued
            await self._abort(subs[: len(collectors)])
            self.rejected.append(Rejected(msg.rid, "param", None, f"{type(err).__name__}: {err}"))
            return
        self.samples[msg.rid] = list(subs)
        self.stats.on_add(len(subs))
        self.accepted.append(msg.rid)
        for sub, queue in zip(subs, collectors, strict=True):
            if self.capture is not None:
                self.capture.on_add(sub, queue.request_id, msg.prompt_ids)
            state = SampleState(sub, len(msg.prompt_ids))
            self.tasks[sub] = asyncio.create_task(
                self._stream(msg.rid, state, queue, params.top_logprobs))

    def _prompt(self, ids: list[int]) -> Any:
        from vllm.inputs import tokens_input

        # The weight version salts the prefix cache: a prompt never reuses KV computed under
        # other weights.
        return tokens_input(ids, cache_salt=f"w:{self.version}")

    async def _stream(self, rid: str, state: SampleState, queue: Any, want_top: int) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            finished = False
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                state.saw_drafter(self.drafter_version)
                for completion in out.outputs:
                    step = step_output(state, out, completion, self.version, want_top)
                    self.outputs.append(step)
                    if self.capture is not None:
                        self.capture.on_output(state.rid, step.token_ids, step.finish)
        except EngineDeadError as err:
            self._die(f"vLLM engine core died: {err}")
        finally:
            queue.close()
            self.tasks.pop(state.rid, None)
            live = self.samples.get(rid)
            if live is not None:
                live.remove(state.rid)
                if not live:
                    del self.samples[rid]
            if not self.samples:
                self.stats.idle()  # the gap until the next request is no step

    async def _abort(self, subs: list[str]) -> None:
        if subs:
            await self.llm.abort(list(subs))

    async def abort_every_sample(self) -> None:
        await self._abort([s for subs in self.samples.values() for s in subs])

    async def _drain_tasks(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=timeout)

    def _die(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            log.error("%s", reason)
            with contextlib.suppress(OSError):
                self.conn.send(Fatal(reason))
            self.inbox.put_nowait(None)

    async def rpc(self, method: str, **kwargs: Any) -> Any:
        """Call our worker extension's ``method`` (``worker.py``) between two engine steps;
        a failure there is a ControlError (the engine goes on)."""
        try:
            results = await asyncio.wait_for(
                self.llm.collective_rpc(method, kwargs=kwargs), RPC_TIMEOUT_S)
        except asyncio.TimeoutError as err:
            raise ControlError(f"{method}: no answer from vLLM's worker in "
                               f"{RPC_TIMEOUT_S:.0f} s") from err
        except Exception as err:
            if self.llm.errored:
                self._die(f"vLLM engine core died: {err}")
            raise ControlError(f"{method} failed in vLLM's worker: {err}") from err
        return results[0]

    # ---- controls ----------------------------------------------------------------------
    async def _control(self, msg: Control) -> None:
        handler = self.controls.get(msg.name)
        try:
            if handler is None:
                raise ControlError(f"unknown control {msg.name!r}")
            payload = await handler(**msg.kwargs)
        except (ControlError, ParamError, TypeError) as err:
            reply = Reply(msg.call_id, False, {"message": str(err),
                                               "weight_version": self.version})
        except Exception as err:  # a failed control must not take the engine down
            log.exception("control %s failed", msg.name)
            reply = Reply(msg.call_id, False, {"message": f"{type(err).__name__}: {err}",
                                               "weight_version": self.version})
        else:
            reply = Reply(msg.call_id, True, payload)
        self._flush(force_stats=True)
        try:
            self.conn.send(reply)
        except OSError:
            self.stopping = True
