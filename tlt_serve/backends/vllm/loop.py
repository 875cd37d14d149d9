"""The vLLM engine process's loop: the front end's messages in, ``StepBatch``es out.

vLLM runs its own scheduler (in its engine-core process) and streams each request's tokens
to an asyncio queue in this process; this loop is an asyncio program around it:

- a reader thread hands the front end's message lists to the loop;
- ``AddRequest``: each of the n samples becomes one vLLM request (``convert.py``) whose DELTA
  outputs a task turns into ``StepOutput``s; they leave through the outbox in one
  ``StepBatch`` per flush (every ``FLUSH_S``, as the native loop sends one per step);
- ``Abort`` / ``AbortAll``: vLLM ends the streams at once with finish ``abort`` (the partial
  tokens were already streamed);
- ``Control``: each runs as a task (``controls.HANDLERS``; requests keep flowing meanwhile);
  a control's outputs (pause abort) go out before its reply;
- the engine core dying ends every request stream with ``EngineDeadError``: the loop reports
  ``Fatal`` and exits, and the front end answers 503 from then on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from tlt_serve.backends.common.outbox import Outbox
from tlt_serve.backends.vllm.controls import HANDLERS, VllmControls
from tlt_serve.backends.vllm.convert import SampleState, check_params, step_output, vllm_params
from tlt_serve.backends.vllm.samples import VllmCapture
from tlt_serve.backends.vllm.stat_logger import LoopStats
from tlt_serve.backends.vllm.state import VllmState
from tlt_serve.contract.controls import Control
from tlt_serve.contract.messages import Abort, AbortAll, AddRequest, Shutdown
from tlt_serve.engine.engine import sample_rids
from tlt_serve.sampling_params import ParamError

log = logging.getLogger("tlt_serve.vllm")
FLUSH_S = 0.005  # outputs gathered this long go out as one StepBatch
DEAD_CHECK_S = 0.5  # how often an idle loop asks whether vLLM's engine core is alive


class VllmLoop:
    def __init__(self, llm: Any, conn: Any, state: VllmState, stats: LoopStats) -> None:
        self.llm = llm
        self.conn = conn
        self.state = state
        self.stats = stats
        # Set by the process before run(): they need the loop (its abort, its death).
        self.capture: VllmCapture | None = None
        self.controls: VllmControls | None = None
        self.outbox = Outbox(conn, lambda: stats.snapshot(state, self.capture),
                             lambda: state.version)
        self.stopping = False
        self.dead: str | None = None
        self.samples: dict[str, list[str]] = {}  # front-end rid → its live sample rids
        self.tasks: dict[str, asyncio.Task[None]] = {}  # sample rid → its stream task
        self.inbox: asyncio.Queue[list[Any] | None] = asyncio.Queue()

    # ---- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(loop,), name="vllm-reader", daemon=True).start()
        flusher = asyncio.create_task(self._flush_forever())
        try:
            while not (self.stopping or self.outbox.closed) and self.dead is None:
                msgs = await self.inbox.get()
                if msgs is None:  # the front end went away
                    break
                for msg in msgs:
                    await self._apply(msg)
        finally:
            await self.abort_every_sample()
            await self._drain_tasks(5.0)
            flusher.cancel()
            self.outbox.flush(force_stats=True)

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                msgs = self.conn.recv()
                loop.call_soon_threadsafe(self.inbox.put_nowait, msgs)
        except (EOFError, OSError):
            loop.call_soon_threadsafe(self.inbox.put_nowait, None)

    async def _flush_forever(self) -> None:
        loop_time = asyncio.get_running_loop().time
        last = loop_time()
        while True:
            await asyncio.sleep(FLUSH_S)
            self.outbox.flush()
            if self.outbox.closed:
                self.inbox.put_nowait(None)
            if loop_time() - last > DEAD_CHECK_S:  # idle, vLLM tells nobody
                last = loop_time()
                if self.llm.errored:
                    self.die("vLLM engine core died")

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
        params, info, outbox = msg.params, self.state.info, self.outbox
        try:
            check_params(params, speculating=info.spec.enabled)
            limit = info.max_num_seqs + info.max_waiting
            if self.state.live + params.n > limit:
                raise OverflowError(f"queue full: {self.state.live} sequences in flight, "
                                    f"limit {limit}")
        except OverflowError as err:
            outbox.reject(msg.rid, "overflow", None, str(err))
            return
        except ParamError as err:
            outbox.reject(msg.rid, "param", err.field, str(err))
            return
        # As natively, an output past the context stops there with finish "length".
        max_tokens = min(params.max_new_tokens, info.max_model_len - len(msg.prompt_ids))
        subs = sample_rids(msg.rid, params.n)
        collectors = []
        try:
            for i, sub in enumerate(subs):
                collectors.append(await self.llm.add_request(
                    sub, self._prompt(msg.prompt_ids, params.cache_salt),
                    vllm_params(params, i, max_tokens)))
        except Exception as err:  # vLLM refused it: nothing of it may stay queued
            await self._abort(subs[: len(collectors)])
            outbox.reject(msg.rid, "param", None, f"{type(err).__name__}: {err}")
            return
        self.samples[msg.rid] = list(subs)
        self.state.live += len(subs)
        self.stats.on_add(len(subs))
        outbox.accept(msg.rid)
        for sub, queue in zip(subs, collectors, strict=True):
            if self.capture is not None:
                self.capture.on_add(sub, queue.request_id, msg.prompt_ids)
            state = SampleState(sub, len(msg.prompt_ids), params)
            self.tasks[sub] = asyncio.create_task(self._stream(msg.rid, state, queue))

    def _prompt(self, ids: list[int], salt: str | None) -> Any:
        from vllm.inputs import tokens_input

        # The weight version salts the prefix cache: a prompt never reuses KV computed under
        # other weights (nor under another request salt).
        own = f"w:{self.state.version}"
        return tokens_input(ids, cache_salt=own if salt is None else f"{own}:{salt}")

    async def _stream(self, rid: str, sample: SampleState, queue: Any) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        state = self.state
        try:
            finished = False
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                sample.saw_drafter(state.drafter_version)
                for completion in out.outputs:
                    step = step_output(sample, out, completion, state.version)
                    self.outbox.outputs.append(step)
                    if self.capture is not None:
                        self.capture.on_output(sample.rid, step.token_ids, step.finish)
        except EngineDeadError as err:
            self.die(f"vLLM engine core died: {err}")
        finally:
            queue.close()
            self.tasks.pop(sample.rid, None)
            state.live -= 1
            live = self.samples.get(rid)
            if live is not None:
                live.remove(sample.rid)
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

    def die(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            log.error("%s", reason)
            self.outbox.fatal(reason)
            self.inbox.put_nowait(None)

    # ---- controls ----------------------------------------------------------------------
    async def _control(self, msg: Control) -> None:
        controls = self.controls
        assert controls is not None
        op = msg.op
        result = await self.outbox.outcome_async(
            type(op).__name__, lambda: HANDLERS[type(op)](controls, op))
        self.outbox.reply(msg.call_id, result)
