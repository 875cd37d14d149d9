"""What a request's timing is and what a load run's timings sum to: ``Timed`` (one request as
its client saw it), ``latency_stats`` (TTFT, TPOT and end-to-end latency: p50 / p90 / p99 and
mean; tokens/s; accept length), ``timeline`` (tokens/s and running sequences over time) and
``small_batch_phase`` (the part of a rollout that speculation can speed up)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timed:
    """Timestamps (monotonic seconds) of one request's life as the client saw it."""

    sent: float
    first: float | None = None  # first token arrived
    done: float | None = None
    tokens: int = 0
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, new tokens)
    error: str | None = None
    accept_length: float | None = None
    verify_ct: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.done is None or self.tokens < 2:
            return None
        return (self.done - self.first) / (self.tokens - 1)

    def note(self, total: int) -> None:
        """``total`` output tokens have arrived so far."""
        now = time.monotonic()
        if total > self.tokens:
            if self.first is None:
                self.first = now
            self.token_times.append((now, total - self.tokens))
            self.tokens = total


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` (no interpolation); None without values."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latency_stats(done: list[Timed], t0: float) -> dict[str, Any]:
    ok = [t for t in done if t.error is None and t.done is not None]
    end = max((t.done for t in ok if t.done is not None), default=t0)
    tokens = sum(t.tokens for t in ok)
    out: dict[str, Any] = {"requests": len(done), "errors": len(done) - len(ok),
                           "tokens": tokens, "seconds": end - t0,
                           "tok_s": tokens / max(end - t0, 1e-9)}
    for name, xs in (("ttft", [t.ttft for t in ok]), ("tpot", [t.tpot for t in ok]),
                     ("e2e", [t.done - t.sent for t in ok if t.done is not None])):
        vals = [x for x in xs if x is not None]
        out[name] = {f"p{int(q * 100)}": pct(vals, q) for q in (0.5, 0.9, 0.99)}
        out[name]["mean"] = statistics.fmean(vals) if vals else None
    verify = sum(t.verify_ct for t in ok)
    if verify:
        out["accept_length"] = sum((t.accept_length or 0) * t.verify_ct for t in ok) / verify
    return out


def timeline(done: list[Timed], t0: float, bin_s: float) -> dict[str, list[float]]:
    """Tokens/s and running sequences per ``bin_s`` bin since ``t0``."""
    end = max((t.done or t0) for t in done)
    bins = max(int(math.ceil((end - t0) / bin_s)), 1)
    tok = [0.0] * bins
    running = [0.0] * bins
    for t in done:
        for when, n in t.token_times:
            tok[min(int((when - t0) / bin_s), bins - 1)] += n / bin_s
        last = int(((t.done or end) - t0) / bin_s)
        for b in range(min(last + 1, bins)):
            running[b] += 1
    return {"t": [b * bin_s for b in range(bins)], "tok_s": tok, "running": running}


def small_batch_phase(ends: list[float], max_batch: int) -> dict[str, float | None]:
    """The part of a rollout that runs with at most ``max_batch`` sequences (where the
    adaptive engine speculates), from the sorted completion times ``ends``, and the makespan
    speedup that phase caps (Amdahl): ``ceiling_free`` if it took no time at all,
    ``ceiling_2x`` if speculation ran it twice as fast. Before the last ``max_batch + 1``-th
    completion more than ``max_batch`` sequences run."""
    if not ends or ends[-1] <= 0:
        return {"small_batch_s": None, "ceiling_free": None, "ceiling_2x": None}
    makespan = ends[-1]
    small = makespan if len(ends) <= max_batch else makespan - ends[-max_batch - 1]
    big = makespan - small  # seconds with more than max_batch running
    return {"small_batch_s": small, "ceiling_free": makespan / big if big > 0 else None,
            "ceiling_2x": makespan / (big + small / 2)}
