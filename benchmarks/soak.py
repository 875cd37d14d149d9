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

    PYTHONPATH=. python3 benchmarks/soak.py --duration 600 --concurrency 512

Writes ``soak.json`` and ``soak.png`` to ``--out-dir`` (default benchmarks/results). Exits 1
if any response was lost, duplicated or failed, if the engine's request count disagrees, or
if the server did not drain to empty.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from tqdm import tqdm

from benchmarks import report
from benchmarks.prompts import ALL
from benchmarks.serverproc import start_server, stop_server
from tlt_serve.models.provision import DEFAULT_MODEL

READ, DISCONNECT, ABORT = "read", "disconnect", "abort"
COMPLETED, ABORTED, ABORT_RACED = "completed", "aborted", "abort_raced"
END_ABORTED, DISCONNECTED, ERROR, LOST = "end_aborted", "disconnected", "error", "lost"
OUTCOMES = (COMPLETED, ABORTED, ABORT_RACED, END_ABORTED, DISCONNECTED, ERROR, LOST)
PROBLEMS_KEPT = 50
MB = 1 << 20


@dataclass(frozen=True)
class SoakConfig:
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
    """One request and what its client will do to it."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    ignore_eos: bool
    mode: str  # READ | DISCONNECT | ABORT
    at_event: int  # disconnect / abort after this many events (0: right after the headers)

    def body(self) -> dict[str, Any]:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                  "ignore_eos": self.ignore_eos}
        return {"input_ids": self.input_ids, "rid": self.rid, "stream": True,
                "sampling_params": params}


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
        if self.dones:
            self.late += 1
        if data == "[DONE]":
            self.dones += 1
            return
        self.events += 1
        try:
            self._event(json.loads(data))
        except (ValueError, KeyError, TypeError) as err:
            self.violations.append(f"malformed event {data[:200]!r}: {err!r}")

    def _event(self, ev: dict[str, Any]) -> None:
        if "error" in ev:
            self.violations.append(f"error event: {ev['error']}")
            return
        meta, ids = ev["meta_info"], list(ev["output_ids"])
        if self.finals:
            self.late += 1
        if meta["id"] != self.plan.rid:
            self.violations.append(f"meta_info.id {meta['id']!r}")
        if ids[: len(self.output)] != self.output:
            self.violations.append(f"output_ids not cumulative at event {self.events}")
        if len(ids) != meta["completion_tokens"]:
            self.violations.append(f"{len(ids)} ids, completion_tokens "
                                   f"{meta['completion_tokens']}")
        if len(ids) > self.plan.max_new_tokens:
            self.violations.append(f"{len(ids)} tokens > max_new_tokens")
        self.output = ids
        if meta["finish_reason"] is not None:
            self.finals += 1
            self.finish = meta["finish_reason"]["type"]
            self._check_finish(len(ids))

    def _check_finish(self, n: int) -> None:
        if self.finish == "length" and n != self.plan.max_new_tokens:
            self.violations.append(f"finish length after {n} of {self.plan.max_new_tokens}")
        if self.finish == "stop" and self.plan.ignore_eos:
            self.violations.append("finish stop although ignore_eos (no stop strings given)")
        if self.finish == "abort" and not (self.abort_sent or self.end_abort):
            self.violations.append("finish abort, but nobody aborted it")


@dataclass
class Ctx:
    """What the client tasks of one run share."""

    cfg: SoakConfig
    http: httpx.AsyncClient  # the streams
    ctl: httpx.AsyncClient  # aborts and stats, never queued behind the streams
    prompts: list[list[int]]
    ledger: Ledger
    t0: float

    @property
    def deadline(self) -> float:
        return self.t0 + self.cfg.duration_s


# ---- one request ------------------------------------------------------------------------


def make_plan(cfg: SoakConfig, prompts: list[list[int]], rng: random.Random, rid: str) -> Plan:
    n = rng.randint(cfg.min_new_tokens, cfg.max_new_tokens)
    u = rng.random()
    mode = READ
    if u < cfg.disconnect_frac:
        mode = DISCONNECT
    elif u < cfg.disconnect_frac + cfg.abort_frac:
        mode = ABORT
    return Plan(rid, rng.choice(prompts), n, rng.choice((0.0, 1.0)),
                rng.random() < cfg.ignore_eos_frac, mode, rng.randint(0, n - 1))


def classify(check: StreamCheck, disconnected: bool) -> str:
    if disconnected:
        return DISCONNECTED
    if check.violations:
        return ERROR
    if check.finals == 0 or check.dones == 0:
        return LOST
    if check.finish == "abort":
        return ABORTED if check.abort_sent else END_ABORTED
    return ABORT_RACED if check.abort_sent else COMPLETED


def record(ledger: Ledger, check: StreamCheck, outcome: str, detail: str = "") -> None:
    rid = check.plan.rid
    ledger.outcomes[outcome] += 1
    ledger.tokens += len(check.output)
    if outcome in (ERROR, LOST):
        ledger.note(outcome, rid, detail or "; ".join(check.violations)
                    or f"events={check.events} finals={check.finals} dones={check.dones}")
    if check.duplicated:
        ledger.duplicates += 1
        ledger.note("duplicate", rid, f"finals={check.finals} dones={check.dones} "
                                      f"late={check.late}")
    if check.finals:
        if rid in ledger.finished_rids:
            ledger.duplicates += 1
            ledger.note("duplicate", rid, "finished twice")
        ledger.finished_rids.add(rid)
    if check.plan.mode == DISCONNECT and outcome != DISCONNECTED:
        ledger.disconnect_missed += 1


async def post_abort(ctl: httpx.AsyncClient, rid: str) -> str | None:
    """POST /abort_request; returns a problem, or None."""
    try:
        resp = await ctl.post("/abort_request", json={"rid": rid})
        if resp.status_code == 200 and resp.json() == {"success": True}:
            return None
    except (httpx.HTTPError, ValueError) as err:
        return f"abort_request failed: {type(err).__name__}: {err}"
    return f"abort_request answered {resp.status_code} {resp.text[:200]}"


async def read_stream(ctx: Ctx, check: StreamCheck, resp: httpx.Response) -> bool:
    """Reads (part of) the SSE stream; True when the plan left it deliberately."""
    plan = check.plan
    if plan.mode == DISCONNECT and plan.at_event == 0:
        return True
    abort: asyncio.Task[str | None] | None = None
    if plan.mode == ABORT and plan.at_event == 0:
        abort = start_abort(ctx, check)
    async for line in resp.aiter_lines():
        before = check.events
        check.line(line)
        if check.events == plan.at_event > before and not check.dones:
            if plan.mode == DISCONNECT:
                return True
            if plan.mode == ABORT and abort is None:
                abort = start_abort(ctx, check)
    if abort is not None and (problem := await abort) is not None:
        check.violations.append(problem)
    return False


def start_abort(ctx: Ctx, check: StreamCheck) -> asyncio.Task[str | None]:
    """POST /abort_request from the control client while this stream keeps being read."""
    check.abort_sent = True
    return asyncio.create_task(post_abort(ctx.ctl, check.plan.rid))


async def refusal_delay(ledger: Ledger, plan: Plan, resp: httpx.Response) -> float | None:
    """A 503 with Retry-After: the delay before retrying (counted). Anything else: None."""
    body = (await resp.aread())[:300].decode(errors="replace")
    retry = resp.headers.get("retry-after")
    if resp.status_code == 503 and retry is not None:
        ledger.retries_503 += 1
        return float(retry)
    ledger.note("http", plan.rid, f"HTTP {resp.status_code}: {body}")
    return None


async def attempt(ctx: Ctx, check: StreamCheck) -> str:
    """POST until answered (503s retried with the same rid); returns the outcome."""
    while True:
        ctx.ledger.attempts += 1
        try:
            async with ctx.http.stream("POST", "/generate", json=check.plan.body()) as resp:
                if resp.status_code == 200:
                    check.accepted = True
                    ctx.ledger.accepted += 1
                    return classify(check, await read_stream(ctx, check, resp))
                delay = await refusal_delay(ctx.ledger, check.plan, resp)
        except httpx.HTTPError as err:
            check.violations.append(f"{type(err).__name__}: {err}")
            return LOST if check.accepted else ERROR
        if delay is None:
            return ERROR
        await asyncio.sleep(delay)


async def one_request(ctx: Ctx, plan: Plan) -> None:
    ctx.ledger.sent += 1
    check = StreamCheck(plan)
    ctx.ledger.open[plan.rid] = check
    try:
        outcome = await attempt(ctx, check)
    except asyncio.CancelledError:
        record(ctx.ledger, check, LOST if check.accepted else ERROR,
               f"still open after the end-of-run abort (events={check.events})")
        raise
    finally:
        del ctx.ledger.open[plan.rid]
    record(ctx.ledger, check, outcome)


async def client_task(ctx: Ctx, index: int) -> None:
    """One closed-loop client: its next request as soon as the last one ends."""
    rng = random.Random(f"{ctx.cfg.seed}-{index}")
    seq = 0
    while time.monotonic() < ctx.deadline:
        rid = f"soak-{ctx.cfg.seed}-{index}-{seq}"
        await one_request(ctx, make_plan(ctx.cfg, ctx.prompts, rng, rid))
        seq += 1


# ---- server state and process memory --------------------------------------------------------


async def server_stats(ctl: httpx.AsyncClient) -> dict[str, int] | None:
    """Running / waiting / in-flight and the engine's counters, fresh from the engine (None if
    it did not answer: /get_server_info waits for the engine's next step)."""
    try:
        resp = await ctl.get("/get_server_info")
        info = resp.json()
        stats = info["stats"]
        keys = ("running", "waiting", "max_num_seqs", "requests", "generated_tokens")
        return {**{k: int(stats[k]) for k in keys}, "in_flight": int(info["in_flight"])}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


METRICS = {"num_requests_running": "running", "num_requests_waiting": "waiting",
           "http_requests_in_flight": "in_flight", "requests_total": "requests",
           "generation_tokens_total": "generated_tokens", "batch_occupancy": "kv_usage"}


async def scraped_stats(ctl: httpx.AsyncClient) -> dict[str, float] | None:
    """The same figures from /metrics, which falls back to the last known ones when the
    engine is in a long step (what a sampler wants: an answer every time)."""
    try:
        resp = await ctl.get("/metrics")
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    out = {}
    for line in resp.text.splitlines():
        name, _, value = line.partition("{")
        key = METRICS.get(name.removeprefix("tlt_serve_"))
        if key is not None:
            out[key] = float(value.rsplit(" ", 1)[1])
    return out if len(out) == len(METRICS) else None


class ProcTree:
    """RSS and CPU of a process (with its descendants when ``tree``)."""

    def __init__(self, pid: int | None, tree: bool) -> None:
        self.root = psutil.Process(pid) if pid is not None else None
        self.tree = tree
        self._last: tuple[float, float] | None = None

    def _procs(self) -> list[psutil.Process]:
        if self.root is None:
            return []
        try:
            return [self.root, *(self.root.children(recursive=True) if self.tree else [])]
        except psutil.NoSuchProcess:
            return []

    def rss_mb(self) -> dict[str, float]:
        """RSS per process, keyed "pid:role"."""
        out = {}
        for p in self._procs():
            try:
                out[f"{p.pid}:{self._role(p)}"] = p.memory_info().rss / MB
            except psutil.NoSuchProcess:
                continue
        return out

    def _role(self, p: psutil.Process) -> str:
        if p == self.root:
            return "main"
        cmd = " ".join(p.cmdline())
        if "resource_tracker" in cmd:
            return "resource_tracker"
        return "spawned (engine)" if "multiprocessing" in cmd else p.name()

    def cpu_pct(self) -> float | None:
        """CPU use since the previous call, in % of one core."""
        total = 0.0
        for p in self._procs():
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        now, last = time.monotonic(), self._last
        self._last = (now, total)
        if last is None or now <= last[0] or not self._procs():
            return None
        return 100.0 * (total - last[1]) / (now - last[0])


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


async def take_sample(ctx: Ctx, server: ProcTree, client: ProcTree) -> Sample:
    stats = await scraped_stats(ctx.ctl)
    rss = server.rss_mb()
    led = ctx.ledger
    return Sample(time.monotonic() - ctx.t0, sum(rss.values()) if rss else None, rss, stats,
                  len(led.open), led.finished, led.tokens, client.cpu_pct(), server.cpu_pct())


def progress_line(samples: list[Sample]) -> dict[str, Any]:
    s = samples[-1]
    post: dict[str, Any] = {"done": s.finished, "open": s.client_in_flight}
    if s.server is not None:
        post["run/wait"] = f"{s.server['running']:.0f}/{s.server['waiting']:.0f}"
    if len(samples) > 1 and s.server is not None and samples[-2].server is not None:
        dt = s.t - samples[-2].t
        post["tok/s"] = round((s.server["generated_tokens"]
                               - samples[-2].server["generated_tokens"]) / max(dt, 1e-9))
    if s.rss_mb is not None:
        post["rss"] = f"{s.rss_mb:.0f}MB"
    if s.client_cpu_pct is not None:
        post["client_cpu"] = f"{s.client_cpu_pct:.0f}%"
    return post


async def sample_loop(ctx: Ctx, server: ProcTree, samples: list[Sample],
                      stop: asyncio.Event) -> None:
    """A sample every ``sample_s`` until ``stop``; a time-based progress bar meanwhile."""
    client = ProcTree(os.getpid(), tree=False)
    client.cpu_pct()
    server.cpu_pct()
    bar = tqdm(total=int(ctx.cfg.duration_s), unit="s", desc="soak",
               disable=not ctx.cfg.progress, dynamic_ncols=True)
    next_at = ctx.t0
    try:
        while not stop.is_set():
            if time.monotonic() >= next_at:
                samples.append(await take_sample(ctx, server, client))
                bar.set_postfix(progress_line(samples), refresh=False)
                next_at += ctx.cfg.sample_s
            bar.update(min(int(time.monotonic() - ctx.t0), bar.total) - bar.n)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), min(1.0, ctx.cfg.sample_s))
    finally:
        bar.close()


async def settle(ctl: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
    """Waits for 0 running / 0 waiting / 0 in flight; the state reached and how long it took."""
    t0 = time.monotonic()
    stats = None
    while time.monotonic() - t0 < timeout_s:
        stats = await server_stats(ctl)
        if stats is not None and stats["running"] == stats["waiting"] == stats["in_flight"] == 0:
            break
        await asyncio.sleep(0.5)
    empty = stats is not None and stats["running"] == stats["waiting"] == stats["in_flight"] == 0
    out: dict[str, Any] = {"empty": empty, "seconds_to_empty": time.monotonic() - t0}
    if stats is not None:
        out.update(running=stats["running"], waiting=stats["waiting"],
                   in_flight=stats["in_flight"], kv_rows_used=stats["running"],
                   kv_rows=stats["max_num_seqs"],
                   kv_usage=stats["running"] / max(stats["max_num_seqs"], 1))
    return out


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
    load_s: float
    drain: dict[str, float]
    wall_s: float


async def prompt_pool(ctl: httpx.AsyncClient, cfg: SoakConfig) -> list[list[int]]:
    """The built-in prompts as chat-templated token ids (the server's own tokenizer), those
    that leave room for ``max_new_tokens``."""
    limit = (await ctl.get("/get_model_info")).json()["max_model_len"] - cfg.max_new_tokens
    pool = []
    for text in ALL:
        resp = await ctl.post("/tokenize", json={"messages": [{"role": "user", "content": text}]})
        resp.raise_for_status()
        ids = resp.json()["tokens"]
        if len(ids) <= limit:
            pool.append(ids)
    if not pool:
        raise RuntimeError(f"no prompt fits max_model_len - max_new_tokens = {limit} tokens")
    return pool


async def abort_open(ctx: Ctx) -> int:
    """Aborts every open request that its client has not aborted already; how many."""
    checks = [c for c in ctx.ledger.open.values() if not c.abort_sent]
    for c in checks:
        c.end_abort = True
    problems = await asyncio.gather(*(post_abort(ctx.ctl, c.plan.rid) for c in checks))
    for c, problem in zip(checks, problems, strict=True):
        if problem is not None:
            c.violations.append(problem)
    return len(checks)


async def drain(ctx: Ctx, tasks: list[asyncio.Task[None]]) -> dict[str, float]:
    """After the load: open requests finish on their own for a while, then get aborted; any
    still open after that are cancelled (lost)."""
    left = max(ctx.deadline - time.monotonic(), 0.0) + ctx.cfg.drain_timeout_s
    _, pending = await asyncio.wait(tasks, timeout=left)
    out = {"open_at_drain_timeout": float(len(ctx.ledger.open)), "end_aborts": 0.0}
    if pending:
        out["end_aborts"] = float(await abort_open(ctx))
        _, pending = await asyncio.wait(pending, timeout=ctx.cfg.end_abort_timeout_s)
    out["drain_s"] = time.monotonic() - ctx.deadline
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            ctx.ledger.outcomes[ERROR] += 1
            ctx.ledger.note("client", "-", f"client task crashed: {t.exception()!r}")
    return out


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
        start = time.monotonic()
        ctx = Ctx(cfg, http, ctl, prompts, Ledger(), start)
        server, stop = ProcTree(pid, tree=True), asyncio.Event()
        samples: list[Sample] = []
        sampler = asyncio.create_task(sample_loop(ctx, server, samples, stop))
        tasks = [asyncio.create_task(client_task(ctx, i)) for i in range(cfg.concurrency)]
        drained = await drain(ctx, tasks)
        kv_end = await settle(ctl, cfg.settle_timeout_s)
        stop.set()
        await sampler
        samples.append(await take_sample(ctx, server, ProcTree(os.getpid(), tree=False)))
        after = await server_stats(ctl)
    return SoakResult(cfg, url, ctx.ledger, samples, sorted(len(p) for p in prompts), before,
                      after, kv_end, cfg.duration_s, drained, time.monotonic() - start)


# ---- summary ------------------------------------------------------------------------------


def fit_slope(samples: list[Sample], lo: float, hi: float) -> tuple[float, float] | None:
    """(MB/min, intercept MB) of a least-squares line through RSS samples with lo <= t <= hi."""
    pts = [(s.t / 60, s.rss_mb) for s in samples if s.rss_mb is not None and lo <= s.t <= hi]
    if len(pts) < 3:
        return None
    slope, icpt = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    return float(slope), float(icpt)


def counts(r: SoakResult) -> dict[str, int]:
    led = r.ledger
    out = {"sent": led.sent, "attempts": led.attempts, "accepted": led.accepted,
           "finished": led.finished, "retries_503": led.retries_503,
           "duplicates": led.duplicates, "disconnect_missed": led.disconnect_missed}
    out.update({k: led.outcomes[k] for k in OUTCOMES})
    out["errors"] = out.pop(ERROR)
    return out


def throughput(r: SoakResult) -> dict[str, Any]:
    gen = None
    if r.before is not None and r.after is not None:
        gen = r.after["generated_tokens"] - r.before["generated_tokens"]
    span = r.load_s + r.drain["drain_s"]
    cpu = [s.client_cpu_pct for s in r.samples if s.client_cpu_pct is not None]
    scpu = [s.server_cpu_pct for s in r.samples if s.server_cpu_pct is not None]
    return {"client_tokens": r.ledger.tokens, "client_tok_s": r.ledger.tokens / span,
            "server_generated_tokens": gen, "server_tok_s": None if gen is None else gen / span,
            "requests_per_s": r.ledger.finished / span,
            "client_cpu_pct_mean": float(np.mean(cpu)) if cpu else None,
            "client_cpu_pct_max": float(np.max(cpu)) if cpu else None,
            "server_cpu_pct_mean": float(np.mean(scpu)) if scpu else None}


def memory(r: SoakResult) -> dict[str, Any]:
    rss = [s for s in r.samples if s.rss_mb is not None]
    whole = fit_slope(r.samples, 0.0, r.load_s)
    half = fit_slope(r.samples, r.load_s / 2, r.load_s)
    load = [s.rss_mb for s in rss if s.t <= r.load_s and s.rss_mb is not None]
    return {
        "rss_start_mb": rss[0].rss_mb if rss else None,
        "rss_end_mb": rss[-1].rss_mb if rss else None,  # after the drain
        "rss_peak_mb": max(load) if load else None,
        "rss_start_by_pid_mb": rss[0].rss_by_pid_mb if rss else None,
        "rss_end_by_pid_mb": rss[-1].rss_by_pid_mb if rss else None,
        "slope_whole_mb_per_min": whole[0] if whole else None,
        "slope_second_half_mb_per_min": half[0] if half else None,
        "fit_whole": whole, "fit_second_half": half,
    }


def accounting(r: SoakResult) -> dict[str, Any]:
    if r.before is None or r.after is None:
        return {"engine_requests_delta": None, "accepted": r.ledger.accepted, "match": False}
    delta = r.after["requests"] - r.before["requests"]
    return {"engine_requests_delta": delta, "accepted": r.ledger.accepted,
            "match": delta == r.ledger.accepted}


def failures(summary: dict[str, Any]) -> list[str]:
    c, out = summary["counts"], []
    for key in ("lost", "duplicates", "errors"):
        if c[key]:
            out.append(f"{key}: {c[key]}")
    if not summary["kv_end"]["empty"]:
        out.append(f"server not empty at the end: {summary['kv_end']}")
    if not summary["accounting"]["match"]:
        out.append(f"engine request count: {summary['accounting']}")
    return out


def summarize(r: SoakResult, server_args: list[str] | None = None) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "benchmark": "soak", "url": r.url, "server_args": server_args,
        "config": asdict(r.cfg), "prompt_lens": r.prompt_lens,
        "counts": counts(r), "throughput": throughput(r), "memory": memory(r),
        "kv_end": r.kv_end, "accounting": accounting(r),
        "timing": {"load_s": r.load_s, **r.drain, "wall_s": r.wall_s},
        "problems": r.ledger.problems,
        "samples": [asdict(s) for s in r.samples],
    }
    summary["failures"] = failures(summary)
    summary["passed"] = not summary["failures"]
    return summary


def _fmt(v: Any) -> str:
    return f"{v:,.2f}" if isinstance(v, float) else str(v)


def print_summary(summary: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = list(summary["counts"].items())
    rows += list(summary["throughput"].items())
    mem = summary["memory"]
    rows += [(k, v) for k, v in mem.items() if not k.startswith("fit") and "by_pid" not in k]
    rows += [(f"kv_end.{k}", v) for k, v in summary["kv_end"].items()]
    rows += [(f"accounting.{k}", v) for k, v in summary["accounting"].items()]
    rows += list(summary["timing"].items())
    width = max(len(k) for k, _ in rows)
    print("\nsoak summary")
    for k, v in rows:
        print(f"  {k:<{width}}  {_fmt(v)}")
    for p in summary["problems"][:20]:
        print(f"  problem: {p}")
    print("  PASSED" if summary["passed"] else f"  FAILED: {'; '.join(summary['failures'])}")


def plot(summary: dict[str, Any], path: Path) -> None:
    plt = report.pyplot()
    ss = summary["samples"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    pts = [(s["t"] / 60, s["rss_mb"]) for s in ss if s["rss_mb"] is not None]
    if pts:
        ax1.plot(*zip(*pts, strict=True), ".-", label="server tree RSS")
    load_min = summary["timing"]["load_s"] / 60
    for name, fit, lo in (("whole", "fit_whole", 0.0), ("2nd half", "fit_second_half",
                                                         load_min / 2)):
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
    ax2.set_ylabel("requests")
    ax2.set_xlabel("minutes")
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
    report.save(fig, path)


def write_outputs(summary: dict[str, Any], out_dir: Path) -> None:
    """``soak.json`` (stamped with machine, date, commit) and ``soak.png`` in ``out_dir``."""
    report.write(summary, out_dir / "soak.json", plot)


# ---- command line -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = SoakConfig()
    p = report.parser(__doc__)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--disconnect-frac", type=float, default=d.disconnect_frac)
    p.add_argument("--abort-frac", type=float, default=d.abort_frac)
    p.add_argument("--ignore-eos-frac", type=float, default=d.ignore_eos_frac)
    p.add_argument("--min-new-tokens", type=int, default=d.min_new_tokens)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--sample-s", type=float, default=d.sample_s)
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="seconds open requests get to finish after the load, before the "
                   "client aborts them")
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="a stream silent this long counts as lost")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--url", default=None, help="soak this running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid (RSS)")
    p.add_argument("--no-progress", action="store_true")
    s = p.add_argument_group("the server started (without --url)")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-model-len", type=int, default=256)
    s.add_argument("--speculative", default="off", help="off | ngram | ...")
    s.add_argument("--server-threads", type=int, default=None, metavar="N",
                   help="OMP_NUM_THREADS for the server (default: torch's own choice); 1 "
                   "avoids thrashing when other work shares the cores")
    return p.parse_args(argv)


def config_from(a: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        duration_s=a.duration, concurrency=a.concurrency, disconnect_frac=a.disconnect_frac,
        abort_frac=a.abort_frac, ignore_eos_frac=a.ignore_eos_frac,
        min_new_tokens=a.min_new_tokens, max_new_tokens=a.max_new_tokens, seed=a.seed,
        sample_s=a.sample_s, drain_timeout_s=a.drain_timeout,
        stall_timeout_s=a.stall_timeout, progress=not a.no_progress,
    )


def server_args(a: argparse.Namespace) -> list[str]:
    return ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs),
            "--max-model-len", str(a.max_model_len), "--speculative", a.speculative]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = config_from(a)
    args = None if a.url else server_args(a)
    proc = None
    if args is None:
        url, pid = a.url, a.pid
    else:
        if a.server_threads is not None:  # inherited by the server (and its engine process)
            os.environ["OMP_NUM_THREADS"] = str(a.server_threads)
        proc, url = start_server(args)
        pid = proc.pid
    try:
        result = asyncio.run(run_soak(url, cfg, pid))
    finally:
        if proc is not None:
            stop_server(proc)
    summary = summarize(result, args)
    summary["server_threads"] = a.server_threads
    print_summary(summary)
    write_outputs(summary, a.out_dir)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
