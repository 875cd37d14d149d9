"""What an engine reports of itself: static facts once at start (``EngineInfo``) and its
counters and live state (``StatsSnapshot``), pushed with outputs and asked for by controls."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tlt_serve.engine.capture import CaptureStats
from tlt_serve.engine.stats import EngineStats, SpecCounts
from tlt_serve.sampling_params import logprob_limit


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
    max_logprobs: int = 20  # top logprobs a request may ask per position (the vocabulary: -1)
    spec: SpecInfo = SpecInfo()
    # Steps run as compiled graphs: vLLM's torch.compile (on a CPU too), the native
    # engine's CUDA graphs; False: eager (--enforce-eager, the native engine's CPU kernels)
    compiled: bool = False

    @property
    def logprob_limit(self) -> int:
        """The most top logprobs a request may ask per position."""
        return logprob_limit(self.max_logprobs, self.vocab_size)


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
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, ever
    prefix_entries: int = 0  # finished sequences' KV kept for reuse now (native engine)
    mixed_steps: int = 0  # prefill steps that decoded running sequences too (native engine)
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
    prefix_hit_tokens: int = 0,
    prefix_entries: int = 0,
) -> StatsSnapshot:
    """An engine's counters and live state as one picklable message (copies, not views)."""
    return StatsSnapshot(
        requests=s.requests,
        prompt_tokens=s.prompt_tokens,
        generated_tokens=s.generated_tokens,
        prefill_steps=s.prefill_steps,
        mixed_steps=s.mixed_steps,
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
        prefix_hit_tokens=prefix_hit_tokens,
        prefix_entries=prefix_entries,
    )
