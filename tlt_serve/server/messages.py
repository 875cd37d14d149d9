"""Typed messages between the HTTP front end and the engine process.

Front end → engine: lists of ``AddRequest | Abort | AbortAll | Control | Shutdown`` (the
sender thread packs whatever is queued into one pickle). Engine → front end: ``Ready`` or
``Failed`` once at start, then ``StepBatch`` (one per engine step and per drained message
batch that produced acknowledgements), ``Reply`` for each ``Control``, ``Fatal`` if the loop
crashes. Everything here must pickle cheaply: plain frozen dataclasses of builtins.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tlt_serve.capture import CaptureStats
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.engine.stats import EngineStats, SpecCounts
from tlt_serve.sampling_params import SamplingParams

# ---- front end → engine -----------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    rid: str  # a front-end rid: aborts all of its samples


@dataclass(frozen=True)
class AbortAll:
    pass


@dataclass(frozen=True)
class Control:
    """An RPC applied between two engine steps; answered by exactly one ``Reply``."""

    call_id: int
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Shutdown:
    """Abort everything (final outputs are still sent), then exit the engine process."""


ToEngine = AddRequest | Abort | AbortAll | Control | Shutdown

# ---- engine → front end -----------------------------------------------------------------


@dataclass(frozen=True)
class SpecInfo:
    """The speculative-decoding settings the engine runs with (``SpecConfig``, resolved)."""

    method: str = "off"  # off | ngram | drafter | auto, as configured
    proposer: str = "none"  # what ``method`` resolved to: none | ngram | drafter
    num_draft_tokens: int = 0
    max_batch: int = 0  # speculate while at most this many sequences run
    drafter: str | None = None  # drafter checkpoint directory
    strategies: tuple[str, ...] = ()  # the policy's arms, e.g. "drafter:4", "drafter:6x3/16"

    @property
    def enabled(self) -> bool:
        return self.proposer != "none"


@dataclass(frozen=True)
class EngineInfo:
    """Static facts the front end needs to validate requests without a round trip."""

    model: str  # the model argument as given
    model_path: str  # resolved local HF directory (the front end loads its tokenizer)
    dtype: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_waiting: int
    eos_ids: tuple[int, ...]
    weight_version: str
    spec: SpecInfo = SpecInfo()


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class Failed:
    """The engine could not start (bad model path, out of memory...)."""

    message: str


@dataclass(frozen=True)
class Rejected:
    """``engine.add_request`` refused a request: ``kind`` is "param" or "overflow"."""

    rid: str
    kind: str
    param: str | None
    message: str


@dataclass(frozen=True)
class StatsSnapshot:
    requests: int
    prompt_tokens: int
    generated_tokens: int
    prefill_steps: int
    decode_steps: int
    running: int
    waiting: int
    max_num_seqs: int
    batch_size: int  # sequences in the last decode batch
    step_buckets: tuple[float, ...]
    step_counts: tuple[int, ...]  # per bucket, non-cumulative; last entry is +Inf
    step_sum: float
    step_count: int
    weight_version: str
    paused: bool
    spec: SpecCounts = field(default_factory=SpecCounts)  # every verify step
    spec_by_bucket: dict[str, SpecCounts] = field(default_factory=dict)  # per batch-size bucket
    recent_accept_length: float = 0.0  # over the last verify steps (EngineStats.recent_spec)
    drafter_version: int | None = None  # the drafter serving now (None: no drafter)
    capture_samples: int = 0  # training samples in the capture buffer
    capture_bytes: int = 0  # their features + tokens
    kv_tokens: int = 0  # tokens held in the KV cache now (vLLM: block-granular)
    # Median tokens/s per batch-size bucket and strategy, as the adaptive policy measured it.
    spec_policy: dict[str, dict[str, float]] = field(default_factory=dict)


def snapshot_of(
    s: EngineStats,
    *,
    running: int,
    waiting: int,
    max_num_seqs: int,
    weight_version: str,
    paused: bool,
    drafter_version: int | None,
    capture: CaptureStats | None,
    spec_policy: dict[str, dict[str, float]] | None = None,
    kv_tokens: int = 0,
) -> StatsSnapshot:
    """An engine's counters and live state as one picklable message (copies, not views)."""
    return StatsSnapshot(
        requests=s.requests,
        prompt_tokens=s.prompt_tokens,
        generated_tokens=s.generated_tokens,
        prefill_steps=s.prefill_steps,
        decode_steps=s.decode_steps,
        running=running,
        waiting=waiting,
        max_num_seqs=max_num_seqs,
        batch_size=s.decode_batch_size,
        step_buckets=tuple(s.step_time.buckets),
        step_counts=tuple(s.step_time.counts),
        step_sum=s.step_time.total,
        step_count=s.step_time.n,
        weight_version=weight_version,
        paused=paused,
        spec=replace(s.spec),
        spec_by_bucket={k: replace(v) for k, v in s.spec_by_bucket.items()},
        recent_accept_length=s.recent_accept_length,
        drafter_version=drafter_version,
        capture_samples=capture.samples if capture is not None else 0,
        capture_bytes=capture.bytes if capture is not None else 0,
        spec_policy=spec_policy or {},
        kv_tokens=kv_tokens,
    )


@dataclass(frozen=True)
class StepBatch:
    """Everything one engine iteration produced, sent as a single message."""

    outputs: list[StepOutput]
    accepted: list[str] = field(default_factory=list)  # front-end rids now queued
    rejected: list[Rejected] = field(default_factory=list)
    stats: StatsSnapshot | None = None


@dataclass(frozen=True)
class Reply:
    call_id: int
    ok: bool
    payload: Any  # a dict of builtins on success, an error message on failure


@dataclass(frozen=True)
class Fatal:
    """The engine loop crashed; the process exits right after sending this."""

    message: str


FromEngine = Ready | Failed | StepBatch | Reply | Fatal
