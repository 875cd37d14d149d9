"""The engine's counters on vLLM, as the native engine keeps them for ``/metrics``.

vLLM reports, for each batch of outputs its engine core sends, the scheduler's state (running
and waiting requests, the step's speculation counts) and the iteration's token counts, to
stat loggers in this process. ``LoopStats`` is such a logger: it feeds the same
``EngineStats`` the native engine fills (speculation per batch-size bucket included). One
vLLM iteration may mix prefill chunks and decoding; it counts as a prefill step when it took
prompt tokens and as a decode step when it generated tokens.
"""

from __future__ import annotations

from typing import Any

from tlt_serve.backends.vllm.samples import VllmCapture
from tlt_serve.backends.vllm.state import VllmState
from tlt_serve.contract.reports import StatsSnapshot, snapshot_of
from tlt_serve.engine.stats import EngineStats, SpecCounts, bucket_name, bucket_of


class LoopStats:
    def __init__(self) -> None:
        self.engine = EngineStats()
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0  # fraction of the KV blocks in use
        self.last_iteration: float | None = None

    def logger_factory(self) -> Any:
        """A vLLM stat-logger factory whose loggers record into this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                stats.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger

    def record(self, scheduler: Any, iteration: Any) -> None:
        s = self.engine
        if scheduler is not None:
            self.running, self.waiting = scheduler.num_running_reqs, scheduler.num_waiting_reqs
            self.kv_usage = scheduler.kv_cache_usage
            spec = scheduler.spec_decoding_stats
            if spec is not None and spec.num_drafts:
                counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
                s.spec.add(*counts)
                name = bucket_name(bucket_of(max(scheduler.num_running_reqs, 1)))
                s.spec_by_bucket.setdefault(name, SpecCounts()).add(*counts)
                s.recent_spec.append((spec.num_accepted_tokens, spec.num_drafts))
        if iteration is not None:
            s.generated_tokens += iteration.num_generation_tokens
            s.prompt_tokens += iteration.num_prompt_tokens
            if iteration.num_prompt_tokens:
                s.prefill_steps += 1
            if iteration.num_generation_tokens:
                s.decode_steps += 1
                s.decode_batch_size = self.running
            now = iteration.iteration_timestamp
            if self.last_iteration is not None:
                s.step_time.observe(now - self.last_iteration)
            self.last_iteration = now

    def on_add(self, n: int) -> None:
        self.engine.requests += n

    def idle(self) -> None:
        """No request in flight: the next iteration's gap is not a step time."""
        self.last_iteration = None

    def snapshot(self, state: VllmState, capture: VllmCapture | None) -> StatsSnapshot:
        busy = state.live > 0
        info = state.info
        return snapshot_of(
            self.engine,
            running=self.running if busy else 0,
            waiting=self.waiting if busy else 0,
            max_num_seqs=info.max_num_seqs,
            weight_version=state.version,
            paused=state.paused,
            drafter_version=state.drafter_version,
            capture=None if capture is None else capture.buffer.stats(),
            kv_tokens=round(self.kv_usage * info.max_num_seqs * info.max_model_len)
            if busy else 0,
        )
