"""``/metrics``: the engine's stats snapshot as Prometheus metric families (prometheus-client).

The engine lives in another process, so nothing here keeps counters: each scrape builds the
families from the snapshot the engine sent (``StatsSnapshot``) and the front end's own state,
in a registry of its own (no process-wide default registry, so two apps in one process do not
collide). Every series carries ``model_name``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from tlt_serve.contract.reports import StatsSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "tlt_serve"
TRAINER_STATES = ("off", "paused", "suspended", "training", "idle")


@dataclass(frozen=True)
class FrontEndView:
    """What the front end knows besides the engine's snapshot."""

    model: str
    alive: bool  # the engine process runs
    in_flight: int  # requests the front end is streaming
    trainer_state: str  # one of TRAINER_STATES


def render_metrics(stats: StatsSnapshot | None, view: FrontEndView) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(stats, view))
    return generate_latest(registry)


class _SnapshotCollector:
    def __init__(self, stats: StatsSnapshot | None, view: FrontEndView) -> None:
        self.stats, self.view = stats, view

    def collect(self) -> Iterator[Metric]:
        view, s = self.view, self.stats
        model = [view.model]
        yield _gauge("engine_alive", "1 while the engine process is running.", int(view.alive),
                     model)
        yield _gauge("http_requests_in_flight", "Requests the front end is streaming.",
                     view.in_flight, model)
        states = GaugeMetricFamily(
            f"{PREFIX}_trainer_state",
            "Drafter trainer state: 1 for the current one (off, paused, suspended while the "
            "server is busy, training, idle).", labels=["model_name", "state"])
        for state in TRAINER_STATES:
            states.add_metric([view.model, state], int(state == view.trainer_state))
        yield states
        if s is None:
            return
        yield _counter("requests", "Sequences added (n samples count n).", s.requests, model)
        yield _counter("prompt_tokens", "Prompt tokens received.", s.prompt_tokens, model)
        yield _counter("generation_tokens", "Tokens generated.", s.generated_tokens, model)
        yield _counter("prefix_cache_hit_tokens", "Prompt tokens whose KV the prefix cache "
                       "held (not computed again).", s.prefix_hit_tokens, model)
        yield _gauge("prefix_cache_entries", "Finished sequences whose KV is kept for reuse.",
                     s.prefix_entries, model)
        yield _counter("prefill_steps", "Prefill forwards.", s.prefill_steps, model)
        yield _counter("mixed_steps", "Prefill forwards that decoded running sequences too.",
                       s.mixed_steps, model)
        yield _counter("decode_steps", "Decode forwards (plain and verify).", s.decode_steps,
                       model)
        yield _gauge("num_requests_running", "Sequences holding a KV row.", s.running, model)
        yield _gauge("num_requests_waiting", "Sequences queued for admission.", s.waiting, model)
        yield _gauge("batch_occupancy", "Running sequences / KV rows.",
                     s.running / max(s.max_num_seqs, 1), model)
        yield _gauge("last_decode_batch_size", "Sequences in the last decode step.",
                     s.batch_size, model)
        yield _gauge("paused", "1 while generation is paused.", int(s.paused), model)
        yield from _vllm_families(s, view.model)
        yield from _spec_families(s, view.model)
        if s.drafter_version is not None:
            yield _gauge("drafter_version", "Version of the drafter serving now.",
                         s.drafter_version, model)
        yield _gauge("capture_buffer_bytes", "Bytes (features + tokens) of captured training "
                     "samples held for the drafter trainer.", s.capture_bytes, model)
        yield _gauge("capture_buffer_samples", "Captured training samples held.",
                     s.capture_samples, model)
        yield _step_histogram(s, view.model)
        info = InfoMetricFamily(f"{PREFIX}_weight_version", "The target weight version served.",
                                labels=["model_name"])
        info.add_metric(model, {"version": s.weight_version})
        yield info


def _vllm_families(s: StatsSnapshot, model: str) -> Iterator[Metric]:
    """The load gauges under vLLM's names, which its schedulers and RL frameworks scrape
    (prime-rl's concurrency control): one engine, ``engine="0"``. A running sequence holds a
    whole KV row, so the cache's use is the rows taken."""
    for name, doc, value in (
            ("num_requests_running", "Sequences holding a KV row.", s.running),
            ("num_requests_waiting", "Sequences queued for admission.", s.waiting),
            ("kv_cache_usage_perc", "KV cache in use, 0-1: rows taken by running sequences.",
             s.running / max(s.max_num_seqs, 1))):
        family = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name", "engine"])
        family.add_metric([model, "0"], value)
        yield family


def _spec_families(s: StatsSnapshot, model: str) -> Iterator[Metric]:
    """Speculation per batch-size bucket of the verify step ("1", "2-4", ..., "65+")."""
    labels = ["model_name", "batch_bucket"]
    steps = CounterMetricFamily(f"{PREFIX}_spec_verify_steps",
                                "Decode steps (batched forwards) that verified drafts.",
                                labels=labels)
    verifies = CounterMetricFamily(f"{PREFIX}_spec_sequence_verifies",
                                   "Sequences that verified drafts, summed over verify steps.",
                                   labels=labels)
    drafted = CounterMetricFamily(f"{PREFIX}_spec_draft_tokens",
                                  "Draft tokens proposed for verification.", labels=labels)
    accepted = CounterMetricFamily(f"{PREFIX}_spec_accepted_tokens",
                                   "Draft tokens accepted (excluding correction / bonus tokens).",
                                   labels=labels)
    length = GaugeMetricFamily(f"{PREFIX}_spec_accept_length",
                               "Accepted drafts per sequence per verify step since start, "
                               "excluding the bonus token.",
                               labels=labels)
    for bucket, c in s.spec_by_bucket.items():
        key = [model, bucket]
        steps.add_metric(key, c.steps)
        verifies.add_metric(key, c.verifies)
        drafted.add_metric(key, c.drafted)
        accepted.add_metric(key, c.accepted)
        length.add_metric(key, c.accepted / c.verifies if c.verifies else 0.0)
    yield from (steps, verifies, drafted, accepted, length)
    yield _gauge("spec_accept_length_recent", "Accept length over the recent verify steps "
                 "(as /get_drafter_info's recent_accept_length).", s.recent_accept_length,
                 [model])


def _step_histogram(s: StatsSnapshot, model: str) -> HistogramMetricFamily:
    hist = HistogramMetricFamily(f"{PREFIX}_step_time_seconds",
                                 "Engine step (forward + sampling) wall time.",
                                 labels=["model_name"])
    cumulative, buckets = 0, []
    bounds = [*(repr(float(b)) for b in s.step_buckets), "+Inf"]
    for bound, count in zip(bounds, s.step_counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    hist.add_metric([model], buckets, s.step_sum)
    return hist


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, value: float, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family
