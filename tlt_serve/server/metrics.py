"""Prometheus text exposition (format 0.0.4), written by hand from an engine stats snapshot."""

from __future__ import annotations

from tlt_serve.server.messages import StatsSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "tlt_serve"


def render_metrics(stats: StatsSnapshot | None, alive: bool, in_flight: int, model: str) -> str:
    lines: list[str] = []
    label = f'{{model_name="{_escape(model)}"}}'

    def metric(name: str, kind: str, help_: str, value: float) -> None:
        lines.append(f"# HELP {PREFIX}_{name} {help_}")
        lines.append(f"# TYPE {PREFIX}_{name} {kind}")
        lines.append(f"{PREFIX}_{name}{label} {_num(value)}")

    metric("engine_alive", "gauge", "1 while the engine process is running.", int(alive))
    metric("http_requests_in_flight", "gauge", "Requests the front end is streaming.", in_flight)
    if stats is None:
        return "\n".join(lines) + "\n"
    metric("requests_total", "counter", "Sequences added (n samples count n).", stats.requests)
    metric("prompt_tokens_total", "counter", "Prompt tokens received.", stats.prompt_tokens)
    metric("generation_tokens_total", "counter", "Tokens generated.", stats.generated_tokens)
    metric("prefill_steps_total", "counter", "Prefill forwards.", stats.prefill_steps)
    metric("decode_steps_total", "counter", "Decode forwards.", stats.decode_steps)
    metric("num_requests_running", "gauge", "Sequences holding a KV row.", stats.running)
    metric("num_requests_waiting", "gauge", "Sequences queued for admission.", stats.waiting)
    metric("batch_occupancy", "gauge", "Running sequences / KV rows.",
           stats.running / max(stats.max_num_seqs, 1))
    metric("last_decode_batch_size", "gauge", "Sequences in the last decode step.",
           stats.batch_size)
    metric("paused", "gauge", "1 while generation is paused.", int(stats.paused))
    metric("spec_verify_steps_total", "counter",
           "Decode steps (batched forwards) that verified draft tokens.", stats.spec_steps)
    metric("spec_sequence_verifies_total", "counter",
           "Sequences that verified draft tokens, summed over verify steps.", stats.spec_verifies)
    metric("spec_draft_tokens_total", "counter", "Draft tokens proposed for verification.",
           stats.spec_drafted)
    metric("spec_accepted_tokens_total", "counter",
           "Draft tokens accepted (excluding correction / bonus tokens).", stats.spec_accepted)
    metric("spec_accept_length", "gauge",
           "Accepted draft tokens per sequence per verify step since start (excluding the "
           "bonus token), as meta_info's spec_accept_length.",
           stats.spec_accepted / stats.spec_verifies if stats.spec_verifies else 0.0)
    name = f"{PREFIX}_step_time_seconds"
    lines.append(f"# HELP {name} Engine step (forward + sampling) wall time.")
    lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    bounds = [*(_num(b) for b in stats.step_buckets), "+Inf"]
    for bound, count in zip(bounds, stats.step_counts, strict=True):
        cumulative += count
        lines.append(f'{name}_bucket{{model_name="{_escape(model)}",le="{bound}"}} {cumulative}')
    lines.append(f"{name}_sum{label} {_num(stats.step_sum)}")
    lines.append(f"{name}_count{label} {stats.step_count}")
    info = f'{{model_name="{_escape(model)}",version="{_escape(stats.weight_version)}"}}'
    lines.append(f"# HELP {PREFIX}_weight_version_info The target weight version being served.")
    lines.append(f"# TYPE {PREFIX}_weight_version_info gauge")
    lines.append(f"{PREFIX}_weight_version_info{info} 1")
    return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
