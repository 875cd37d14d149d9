"""Counters and histograms the engine keeps for /metrics and benchmarks (no globals)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tlt_serve.engine.outputs import StepOutput
from tlt_serve.engine.scheduler import Emitted, Sampled, ScheduledBatch

# Upper bounds of batch-size buckets: 1, 2-4, 5-8, 9-16, 17-32, 33-64, 65+.
BUCKETS = (1, 4, 8, 16, 32, 64)


def bucket_of(batch_size: int) -> int:
    """Index of the batch-size bucket ``batch_size`` falls in (0 .. len(BUCKETS))."""
    return bisect.bisect_left(BUCKETS, batch_size)


def bucket_name(index: int) -> str:
    """A bucket's label, as /get_server_info and /metrics show it: "1", "2-4", ..., "65+"."""
    lo = 1 if index == 0 else BUCKETS[index - 1] + 1
    if index == len(BUCKETS):
        return f"{lo}+"
    return str(lo) if lo == BUCKETS[index] else f"{lo}-{BUCKETS[index]}"


STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
RECENT_SPEC_STEPS = 256  # window of the recent accept length


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


@dataclass
class SpecCounts:
    """Verification counters of the decode steps in one batch-size bucket."""

    steps: int = 0  # decode steps (batched forwards) that verified drafts
    verifies: int = 0  # sequences verified, summed over those steps
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted (excluding correction / bonus tokens)

    def add(self, verifies: int, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.verifies += verifies
        self.drafted += drafted
        self.accepted += accepted


@dataclass
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    mixed_steps: int = 0  # prefill steps that decoded running sequences too
    decode_steps: int = 0
    decode_batch_size: int = 0  # sequences in the last decode step
    spec: SpecCounts = field(default_factory=SpecCounts)  # all verify steps
    # the same per batch-size bucket of the verify step (speculative.policy's buckets)
    spec_by_bucket: dict[str, SpecCounts] = field(default_factory=dict)
    step_time: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))
    # (accepted, verifies) of the last RECENT_SPEC_STEPS verify steps
    recent_spec: deque[tuple[int, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT_SPEC_STEPS)
    )

    @property
    def recent_accept_length(self) -> float:
        """Accepted drafts per sequence verification over the recent verify steps."""
        verifies = sum(v for _, v in self.recent_spec)
        return sum(a for a, _ in self.recent_spec) / verifies if verifies else 0.0

    def on_add(self, n: int, prompt_len: int) -> None:
        self.requests += n
        self.prompt_tokens += prompt_len

    def on_step(
        self,
        batch: ScheduledBatch,
        emitted: Sampled | Emitted,
        outputs: Sequence[StepOutput],
        seconds: float,
    ) -> None:
        self.generated_tokens += sum(len(o.token_ids) for o in outputs)
        if isinstance(emitted, Emitted) and emitted.drafted is not None:
            verifies, accepted = sum(1 for d in emitted.drafted if d), sum(emitted.accepted or ())
            drafted = sum(emitted.drafted)
            self.spec.add(verifies, drafted, accepted)
            name = bucket_name(bucket_of(len(batch.samplers)))
            self.spec_by_bucket.setdefault(name, SpecCounts()).add(verifies, drafted, accepted)
            self.recent_spec.append((accepted, verifies))
        if batch.is_prefill:
            self.prefill_steps += 1
            self.mixed_steps += int(batch.decodes > 0)
        else:
            self.decode_steps += 1
            self.decode_batch_size = len(batch.samplers)
        self.step_time.observe(seconds)
