"""Load-and-soak benchmark of the HTTP server: hundreds of concurrent streaming ``/generate``
requests on loopback, with random client disconnects and aborts, for minutes.

What it measures:
  correctness  every response, as its client saw it. A stream read to the end must carry
               exactly one final event (with a finish_reason) and exactly one ``[DONE]``,
               output_ids that only ever extend (cumulative), ``meta_info.id`` equal to the
               rid sent, completion_tokens == len(output_ids). An aborted one must end with
               finish_reason "abort" (or finish normally if the abort raced the finish).
               lost: accepted, not deliberately left, yet never finished (stream cut, hang);
               duplicates: a second final event or ``[DONE]``, or a rid finished twice;
               errors: any other failure (non-200 other than 503 + Retry-After, which is
               counted and retried with the same rid, a malformed or inconsistent event).
               The engine's request counter must have grown by exactly the requests accepted.
  drain        when the load stops, open requests get ``--drain-timeout`` s to finish on their
               own; the client then aborts the rest (/abort_request: they must end with
               finish_reason abort, counted as end_aborted), and the server must report 0
               running / waiting / in flight. The KV cache is slot-based (one fixed row per
               running sequence, allocated once), so KV rows in use == running sequences
               (``tlt_serve_batch_occupancy`` in /metrics).
  memory       resident memory (RSS) of the server's process tree (front end + engine
               process + children) every ``--sample-s``; the linear slope in MB/min over the
               whole load phase and over its second half (after warm-up).
  throughput   tokens/s (client-received and engine-generated) and the client's own CPU use,
               to show that the client is not the bottleneck.

    python -m benchmarks.stress.soak --duration-s 600 --concurrency 512

Writes ``soak.json`` and ``soak.png`` to benchmarks/results. Exits 1 if any response was
lost, duplicated or failed, if the engine's request count disagrees, or if the server did
not drain to empty.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from benchmarks.common.prompts import ALL
from benchmarks.common.results import parse, parser, pyplot, report, save
from benchmarks.common.servers import start_server, stop_server
from benchmarks.common.watch import ProcTree, scraped_stats, server_stats, settle

READ, DISCONNECT, ABORT = "read", "disconnect", "abort"
COMPLETED, ABORTED, ABORT_RACED = "completed", "aborted", "abort_raced"
END_ABORTED, DISCONNECTED, ERROR, LOST = "end_aborted", "disconnected", "error", "lost"
OUTCOMES = (COMPLETED, ABORTED, ABORT_RACED, END_ABORTED, DISCONNECTED, ERROR, LOST)
PROBLEMS_KEPT = 50


@dataclass(frozen=True)
class SoakConfig:
    """A soak run; each field is a flag (``--duration-s`` ...). ``duration_s``: seconds of
    load; ``sample_s``: seconds between samples of the server's state and memory."""

    duration_s: float = 600.0
    concurrency: int = 512
    disconnect_frac: float = 0.1
    abort_frac: float = 0.1
    ignore_eos_frac: float = 0.3
    min_new_tokens: int = 8
    max_new_tokens: int = 64
    seed: int = 0
    sample_s: float = 10.0
    # When the load stops, open requests get drain_timeout_s to finish on their own; then
    # the client aborts the rest (/abort_request) and gives them end_abort_timeout_s to end
    # (with finish_reason abort); still open after that: lost.
    drain_timeout_s: float = 60.0
    end_abort_timeout_s: float = 120.0
    settle_timeout_s: float = 120.0  # then, for the server to report empty
    stall_timeout_s: float = 900.0  # a stream silent this long (queued or hung) is lost
    progress: bool = True


@dataclass(frozen=True)
class Plan:
    """One request and what its client will do to it: read it to the end, or disconnect or
    abort after ``at_event`` events (0: right after the headers)."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    ignore_eos: bool
    mode: str  # READ | DISCONNECT | ABORT
    at_event: int

    @classmethod
    def draw(cls, cfg: SoakConfig, prompts: list[list[int]], rng: random.Random,
             rid: str) -> Plan:
        n = rng.randint(cfg.min_new_tokens, cfg.max_new_tokens)
        u = rng.random()
        mode = (DISCONNECT if u < cfg.disconnect_frac
                else ABORT if u < cfg.disconnect_frac + cfg.abort_frac else READ)
        return cls(rid, rng.choice(prompts), n, rng.choice((0.0, 1.0)),
                   rng.random() < cfg.ignore_eos_frac, mode, rng.randint(0, n - 1))

    def body(self) -> dict[str, Any]:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                  "ignore_eos": self.ignore_eos}
        return {"input_ids": self.input_ids, "rid": self.rid, "stream": True,
                "sampling_params": params}


@dataclass
class StreamCheck:
    """Protocol checks over one SSE stream, fed line by line."""

    plan: Plan
    accepted: bool = False
    abort_sent: bool = False
    end_abort: bool = False  # aborted by the client when the load stopped
    events: int = 0
    finals: int = 0
    dones: int = 0
    late: int = 0  # events after a final event, anything after [DONE]
    output: list[int] = field(default_factory=list)
    finish: str | None = None
    violations: list[str] = field(default_factory=list)

    @property
    def duplicated(self) -> bool:
        return self.finals > 1 or self.dones > 1 or self.late > 0

    def line(self, line: str) -> None:
        if not line.startswith("data: "):
            return  # event separators
        data = line[len("data: "):]
        self.late += self.dones > 0
        if data == "[DONE]":
            self.dones += 1
            return
        self.events += 1
        try:
            self._event(json.loads(data))
        except (ValueError, KeyError, TypeError) as err:
            self.violations.append(f"malformed event {data[:200]!r}: {err!r}")

    def _event(self, ev: dict[str, Any]) -> None:
        bad, plan = self.violations.append, self.plan
        if "error" in ev:
            bad(f"error event: {ev['error']}")
            return
        meta, ids = ev["meta_info"], list(ev["output_ids"])
        self.late += self.finals > 0
        if meta["id"] != plan.rid:
            bad(f"meta_info.id {meta['id']!r}")
        if ids[: len(self.output)] != self.output:
            bad(f"output_ids not cumulative at event {self.events}")
        if len(ids) != meta["completion_tokens"]:
            bad(f"{len(ids)} ids, completion_tokens {meta['completion_tokens']}")
        if len(ids) > plan.max_new_tokens:
            bad(f"{len(ids)} tokens > max_new_tokens")
        self.output = ids
        if meta["finish_reason"] is None:
            return
        self.finals += 1
        self.finish = meta["finish_reason"]["type"]
        if self.finish == "length" and len(ids) != plan.max_new_tokens:
            bad(f"finish length after {len(ids)} of {plan.max_new_tokens}")
        if self.finish == "stop" and plan.ignore_eos:
            bad("finish stop although ignore_eos (no stop strings given)")
        if self.finish == "abort" and not (self.abort_sent or self.end_abort):
            bad("finish abort, but nobody aborted it")

    def outcome(self, disconnected: bool) -> str:
        if disconnected:
            return DISCONNECTED
        if self.violations:
            return ERROR
        if self.finals == 0 or self.dones == 0:
            return LOST
        if self.finish == "abort":
            return ABORTED if self.abort_sent else END_ABORTED
        return ABORT_RACED if self.abort_sent else COMPLETED


@dataclass
class Ledger:
    """Every request's fate as its client saw it (owned by one soak run)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    sent: int = 0  # distinct rids
    attempts: int = 0  # POSTs, 503 retries included
    accepted: int = 0  # 200 responses
    retries_503: int = 0
    duplicates: int = 0
    disconnect_missed: int = 0  # planned to leave, but the stream finished first
    tokens: int = 0  # output tokens received (the last event's output_ids of every stream)
    open: dict[str, StreamCheck] = field(default_factory=dict)  # rid → its stream's checks
    finished_rids: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def note(self, kind: str, rid: str, detail: str) -> None:
        if len(self.problems) < PROBLEMS_KEPT:
            self.problems.append(f"{kind} {rid}: {detail}")

    @property
    def finished(self) -> int:
        return sum(self.outcomes.values())

    def record(self, check: StreamCheck, outcome: str, detail: str = "") -> None:
        c, rid = check, check.plan.rid
        self.outcomes[outcome] += 1
        self.tokens += len(c.output)
        if outcome in (ERROR, LOST):
            self.note(outcome, rid, detail or "; ".join(c.violations)
                      or f"events={c.events} finals={c.finals} dones={c.dones}")
        if c.duplicated:
            self.duplicates += 1
            self.note("duplicate", rid, f"finals={c.finals} dones={c.dones} late={c.late}")
        if c.finals:
            if rid in self.finished_rids:
                self.duplicates += 1
                self.note("duplicate", rid, "finished twice")
            self.finished_rids.add(rid)
        if c.plan.mode == DISCONNECT and outcome != DISCONNECTED:
            self.disconnect_missed += 1


# ---- the clients ------------------------------------------------------------------------


async def post_abort(ctl: httpx.AsyncClient, rid: str) -> str | None:
    """POST /abort_request; returns a problem, or None."""
    try:
        resp = await ctl.post("/abort_request", json={"rid": rid})
        if resp.status_code == 200 and resp.json() == {"success": True}:
            return None
    except (httpx.HTTPError, ValueError) as err:
        return f"abort_request failed: {type(err).__name__}: {err}"
    return f"abort_request answered {resp.status_code} {resp.text[:200]}"


class Clients:
    """The closed-loop clients of one run: streams on ``http``, aborts and stats on ``ctl``
    (never queued behind the streams)."""

    def __init__(self, cfg: SoakConfig, http: httpx.AsyncClient, ctl: httpx.AsyncClient,
                 prompts: list[list[int]]) -> None:
        self.cfg, self.http, self.ctl, self.prompts = cfg, http, ctl, prompts
        self.ledger = Ledger()
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg.duration_s

    async def client(self, index: int) -> None:
        """One client: its next request as soon as the last one ends, until the deadline."""
        rng, seq = random.Random(f"{self.cfg.seed}-{index}"), 0
        while time.monotonic() < self.deadline:
            rid = f"soak-{self.cfg.seed}-{index}-{seq}"
            await self.request(Plan.draw(self.cfg, self.prompts, rng, rid))
            seq += 1

    async def request(self, plan: Plan) -> None:
        self.ledger.sent += 1
        check = self.ledger.open[plan.rid] = StreamCheck(plan)
        try:
            outcome = await self.attempt(check)
        except asyncio.CancelledError:
            self.ledger.record(check, LOST if check.accepted else ERROR,
                               f"still open after the end-of-run abort (events={check.events})")
            raise
        finally:
            del self.ledger.open[plan.rid]
        self.ledger.record(check, outcome)

    async def attempt(self, check: StreamCheck) -> str:
        """POST until answered (a 503 with Retry-After is counted and retried with the same
        rid); returns the outcome."""
        led, rid = self.ledger, check.plan.rid
        while True:
            led.attempts += 1
            try:
                async with self.http.stream("POST", "/generate", json=check.plan.body()) as resp:
                    if resp.status_code == 200:
                        check.accepted = True
                        led.accepted += 1
                        return check.outcome(await self.read(check, resp))
                    body = (await resp.aread())[:300].decode(errors="replace")
            except httpx.HTTPError as err:
                check.violations.append(f"{type(err).__name__}: {err}")
                return LOST if check.accepted else ERROR
            retry = resp.headers.get("retry-after")
            if resp.status_code != 503 or retry is None:
                led.note("http", rid, f"HTTP {resp.status_code}: {body}")
                return ERROR
            led.retries_503 += 1
            await asyncio.sleep(float(retry))

    async def read(self, check: StreamCheck, resp: httpx.Response) -> bool:
        """Reads (part of) the SSE stream; True when the plan left it deliberately."""
        plan = check.plan
        if plan.mode == DISCONNECT and plan.at_event == 0:
            return True
        abort = self.abort(check) if plan.mode == ABORT and plan.at_event == 0 else None
        async for line in resp.aiter_lines():
            before = check.events
            check.line(line)
            if check.events == plan.at_event > before and not check.dones:
                if plan.mode == DISCONNECT:
                    return True
                if plan.mode == ABORT and abort is None:
                    abort = self.abort(check)
        if abort is not None and (problem := await abort) is not None:
            check.violations.append(problem)
        return False

    def abort(self, check: StreamCheck, at_end: bool = False) -> asyncio.Task[str | None]:
        """POST /abort_request from the control client while this stream keeps being read
        (``at_end``: the client's own abort of a request still open when the load stopped)."""
        if at_end:
            check.end_abort = True
        else:
            check.abort_sent = True
        return asyncio.create_task(post_abort(self.ctl, check.plan.rid))

    async def drain(self, tasks: list[asyncio.Task[None]]) -> dict[str, float]:
        """After the load: open requests finish on their own for a while, then get aborted;
        any still open after that are cancelled (lost)."""
        led = self.ledger
        left = max(self.deadline - time.monotonic(), 0.0) + self.cfg.drain_timeout_s
        _, pending = await asyncio.wait(tasks, timeout=left)
        out = {"open_at_drain_timeout": float(len(led.open)), "end_aborts": 0.0}
        if pending:
            checks = [c for c in led.open.values() if not c.abort_sent]
            aborts = [self.abort(c, at_end=True) for c in checks]
            for c, problem in zip(checks, await asyncio.gather(*aborts), strict=True):
                if problem is not None:
                    c.violations.append(problem)
            out["end_aborts"] = float(len(checks))
            _, pending = await asyncio.wait(pending, timeout=self.cfg.end_abort_timeout_s)
        out["drain_s"] = time.monotonic() - self.deadline
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                led.outcomes[ERROR] += 1
                led.note("client", "-", f"client task crashed: {t.exception()!r}")
        return out


# ---- samples ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the load started
    rss_mb: float | None
    rss_by_pid_mb: dict[str, float]
    server: dict[str, float] | None
    client_in_flight: int
    finished: int
    client_tokens: int
    client_cpu_pct: float | None
    server_cpu_pct: float | None

    def progress(self, before: Sample | None) -> dict[str, Any]:
        """The progress bar's figures."""
        post: dict[str, Any] = {"done": self.finished, "open": self.client_in_flight}
        if self.server is not None:
            post["run/wait"] = f"{self.server['running']:.0f}/{self.server['waiting']:.0f}"
            if before is not None and before.server is not None:
                post["tok/s"] = round((self.server["generated_tokens"]
                                       - before.server["generated_tokens"])
                                      / max(self.t - before.t, 1e-9))
        if self.rss_mb is not None:
            post["rss"] = f"{self.rss_mb:.0f}MB"
        if self.client_cpu_pct is not None:
            post["client_cpu"] = f"{self.client_cpu_pct:.0f}%"
        return post


async def take_sample(run: Clients, server: ProcTree, client: ProcTree) -> Sample:
    stats, rss, led = await scraped_stats(run.ctl), server.rss_mb(), run.ledger
    return Sample(time.monotonic() - run.t0, sum(rss.values()) if rss else None, rss, stats,
                  len(led.open), led.finished, led.tokens, client.cpu_pct(), server.cpu_pct())


async def sample_loop(run: Clients, server: ProcTree, samples: list[Sample],
                      stop: asyncio.Event) -> None:
    """A sample every ``sample_s`` until ``stop``; a time-based progress bar meanwhile."""
    client = ProcTree(os.getpid(), tree=False)
    client.cpu_pct()
    server.cpu_pct()
    bar = tqdm(total=int(run.cfg.duration_s), unit="s", desc="soak",
               disable=not run.cfg.progress, dynamic_ncols=True)
    next_at = run.t0
    try:
        while not stop.is_set():
            if time.monotonic() >= next_at:
                samples.append(await take_sample(run, server, client))
                bar.set_postfix(samples[-1].progress(samples[-2] if len(samples) > 1 else None),
                                refresh=False)
                next_at += run.cfg.sample_s
            bar.update(min(int(time.monotonic() - run.t0), bar.total) - bar.n)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), min(1.0, run.cfg.sample_s))
    finally:
        bar.close()


# ---- a run ------------------------------------------------------------------------------


@dataclass
class SoakResult:
    cfg: SoakConfig
    url: str
    ledger: Ledger
    samples: list[Sample]
    prompt_lens: list[int]
    before: dict[str, int] | None
    after: dict[str, int] | None
    kv_end: dict[str, Any]
    drain: dict[str, float]
    wall_s: float


async def prompt_pool(ctl: httpx.AsyncClient, cfg: SoakConfig) -> list[list[int]]:
    """The benchmark prompts as chat-templated token ids (the server's own tokenizer), those
    that leave room for ``max_new_tokens``."""
    limit = (await ctl.get("/get_model_info")).json()["max_model_len"] - cfg.max_new_tokens
    pool = []
    for text in ALL:
        resp = await ctl.post("/tokenize", json={"messages": [{"role": "user", "content": text}]})
        if len(ids := resp.raise_for_status().json()["tokens"]) <= limit:
            pool.append(ids)
    if not pool:
        raise RuntimeError(f"no prompt fits max_model_len - max_new_tokens = {limit} tokens")
    return pool


async def run_soak(url: str, cfg: SoakConfig, pid: int | None) -> SoakResult:
    """The whole run against ``url``; ``pid``: the server process whose tree's RSS to sample
    (None: skip memory)."""
    n = cfg.concurrency + 16
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(cfg.stall_timeout_s, connect=60.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http, \
            httpx.AsyncClient(base_url=url, timeout=60.0) as ctl:
        prompts = await prompt_pool(ctl, cfg)
        before = await server_stats(ctl)
        run = Clients(cfg, http, ctl, prompts)
        server, stop = ProcTree(pid, tree=True), asyncio.Event()
        samples: list[Sample] = []
        sampler = asyncio.create_task(sample_loop(run, server, samples, stop))
        drained = await run.drain([asyncio.create_task(run.client(i))
                                   for i in range(cfg.concurrency)])
        kv_end = await settle(ctl, cfg.settle_timeout_s)
        stop.set()
        await sampler
        samples.append(await take_sample(run, server, ProcTree(os.getpid(), tree=False)))
        after = await server_stats(ctl)
    return SoakResult(cfg, url, run.ledger, samples, sorted(len(p) for p in prompts), before,
                      after, kv_end, drained, time.monotonic() - run.t0)


# ---- summary ------------------------------------------------------------------------------


def fit_slope(samples: list[Sample], lo: float, hi: float) -> tuple[float, float] | None:
    """(MB/min, intercept MB) of a least-squares line through RSS samples with lo <= t <= hi."""
    pts = [(s.t / 60, s.rss_mb) for s in samples if s.rss_mb is not None and lo <= s.t <= hi]
    if len(pts) < 3:
        return None
    slope, icpt = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    return float(slope), float(icpt)


def summarize(r: SoakResult, server_args: list[str] | None = None) -> dict[str, Any]:
    """The run's figures (counts, throughput, memory, the server at the end, the engine's
    request count against the accepted requests) and its ``failures``."""
    led, load_s, ss = r.ledger, r.cfg.duration_s, r.samples
    counts = {"sent": led.sent, "attempts": led.attempts, "accepted": led.accepted,
              "finished": led.finished, "retries_503": led.retries_503,
              "duplicates": led.duplicates, "disconnect_missed": led.disconnect_missed,
              **{k: led.outcomes[k] for k in OUTCOMES}}
    counts["errors"] = counts.pop(ERROR)
    gen = delta = None
    if r.before is not None and r.after is not None:
        gen = r.after["generated_tokens"] - r.before["generated_tokens"]
        delta = r.after["requests"] - r.before["requests"]
    span = load_s + r.drain["drain_s"]

    def stat(xs: list[float | None], f: Callable[[Any], Any] = np.mean) -> float | None:
        """``f`` of the values that are known (None: none is)."""
        return float(f(vals)) if (vals := [x for x in xs if x is not None]) else None

    rss = [s for s in ss if s.rss_mb is not None]
    whole, half = fit_slope(ss, 0.0, load_s), fit_slope(ss, load_s / 2, load_s)
    summary: dict[str, Any] = {
        "url": r.url, "server_args": server_args, "config": asdict(r.cfg),
        "prompt_lens": r.prompt_lens, "counts": counts,
        "throughput": {
            "client_tokens": led.tokens, "client_tok_s": led.tokens / span,
            "server_generated_tokens": gen, "server_tok_s": None if gen is None else gen / span,
            "requests_per_s": led.finished / span,
            "client_cpu_pct_mean": stat([s.client_cpu_pct for s in ss]),
            "client_cpu_pct_max": stat([s.client_cpu_pct for s in ss], np.max),
            "server_cpu_pct_mean": stat([s.server_cpu_pct for s in ss])},
        "memory": {
            "rss_start_mb": rss[0].rss_mb if rss else None,
            "rss_end_mb": rss[-1].rss_mb if rss else None,  # after the drain
            "rss_peak_mb": stat([s.rss_mb for s in rss if s.t <= load_s], np.max),
            "rss_start_by_pid_mb": rss[0].rss_by_pid_mb if rss else None,
            "rss_end_by_pid_mb": rss[-1].rss_by_pid_mb if rss else None,
            "slope_whole_mb_per_min": whole[0] if whole else None,
            "slope_second_half_mb_per_min": half[0] if half else None,
            "fit_whole": whole, "fit_second_half": half},
        "kv_end": r.kv_end,
        "accounting": {"engine_requests_delta": delta, "accepted": led.accepted,
                       "match": delta == led.accepted},
        "timing": {"load_s": load_s, **r.drain, "wall_s": r.wall_s},
        "problems": led.problems, "samples": [asdict(s) for s in ss],
    }
    failures = [f"{k}: {counts[k]}" for k in ("lost", "duplicates", "errors") if counts[k]]
    if not r.kv_end["empty"]:
        failures.append(f"server not empty at the end: {r.kv_end}")
    if not summary["accounting"]["match"]:
        failures.append(f"engine request count: {summary['accounting']}")
    return {**summary, "failures": failures, "passed": not failures}


def print_summary(summary: dict[str, Any]) -> None:
    shown = {k: summary[k] for k in ("counts", "throughput", "memory", "kv_end", "accounting",
                                     "timing")}
    shown["memory"] = {k: v for k, v in shown["memory"].items()
                       if not k.startswith("fit") and "by_pid" not in k}
    print(json.dumps(shown, indent=1))
    for p in summary["problems"][:20]:
        print(f"problem: {p}")
    print("PASSED" if summary["passed"] else f"FAILED: {'; '.join(summary['failures'])}")


def plot(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    ss = summary["samples"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    pts = [(s["t"] / 60, s["rss_mb"]) for s in ss if s["rss_mb"] is not None]
    if pts:
        ax1.plot(*zip(*pts, strict=True), ".-", label="server tree RSS")
    load_min = summary["timing"]["load_s"] / 60
    for name, fit, lo in (("whole", "fit_whole", 0.0),
                          ("2nd half", "fit_second_half", load_min / 2)):
        if summary["memory"][fit]:
            slope, icpt = summary["memory"][fit]
            xs = np.array([lo, load_min])
            ax1.plot(xs, slope * xs + icpt, "--", label=f"fit {name}: {slope:+.2f} MB/min")
    for ax in (ax1, ax2):
        ax.axvline(load_min, color="grey", lw=0.8, ls="-.")  # the load stops: drain
    ax1.set_ylabel("RSS (MB)")
    ax1.legend()
    srv = [s for s in ss if s["server"] is not None]
    t = [s["t"] / 60 for s in srv]
    ax2.plot(t, [s["server"]["running"] for s in srv], label="running (KV rows)")
    ax2.plot(t, [s["server"]["waiting"] for s in srv], label="waiting")
    ax2.plot([s["t"] / 60 for s in ss], [s["client_in_flight"] for s in ss], label="client open")
    ax2.set(ylabel="requests", xlabel="minutes")
    ax3 = ax2.twinx()
    rate = [(b["t"] / 60, (b["server"]["generated_tokens"] - a["server"]["generated_tokens"])
             / max(b["t"] - a["t"], 1e-9)) for a, b in zip(srv, srv[1:], strict=False)]
    if rate:
        ax3.plot(*zip(*rate, strict=True), "k:", label="tokens/s")
    ax3.set_ylabel("tokens/s")
    ax2.legend(loc="upper left")
    ax3.legend(loc="upper right")
    c = summary["counts"]
    fig.suptitle(f"soak: {c['finished']} requests, lost {c['lost']}, dups {c['duplicates']}, "
                 f"errors {c['errors']}, KV empty at end: {summary['kv_end']['empty']}")
    save(fig, path)


# ---- command line -------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The run's flags (one per ``SoakConfig`` field) and the server's."""
    p = parser(__doc__, "soak")
    for f in dataclasses.fields(SoakConfig):
        flag = f"--{f.name.replace('_', '-')}"
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    p.add_argument("--url", default=None, help="soak this running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid (RSS)")
    s = p.add_argument_group("the server started (without --url)")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-model-len", type=int, default=256)
    s.add_argument("--speculative", default="off", help="off | ngram | ...")
    s.add_argument("--server-threads", type=int, default=None, metavar="N",
                   help="OMP_NUM_THREADS for the server (default: torch's own choice); 1 "
                   "avoids thrashing when other work shares the cores")
    return parse(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = SoakConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(SoakConfig)})
    args, proc, url, pid = None, None, a.url, a.pid
    if not a.url:  # OMP_NUM_THREADS: inherited by the server's engine process
        args = ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs),
                "--max-model-len", str(a.max_model_len), "--speculative", a.speculative]
        threads = {} if a.server_threads is None else {"OMP_NUM_THREADS": str(a.server_threads)}
        proc, url = start_server(args, threads)
        pid = proc.pid
    try:
        result = asyncio.run(run_soak(url, cfg, pid))
    finally:
        if proc is not None:
            stop_server(proc)
    summary = summarize(result, args)
    print_summary(summary)
    report(a, summary, plot)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
