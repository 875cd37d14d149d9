"""What a benchmark reads off a running ``tlt-serve serve``: its counters (fresh from the
engine, or from /metrics, which answers even while the engine is in a long step), whether it
has drained to empty, and the memory and CPU of its processes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil

MB = 1 << 20
METRICS = {"num_requests_running": "running", "num_requests_waiting": "waiting",
           "http_requests_in_flight": "in_flight", "requests_total": "requests",
           "generation_tokens_total": "generated_tokens", "batch_occupancy": "kv_usage"}


async def server_stats(ctl: httpx.AsyncClient) -> dict[str, int] | None:
    """Running / waiting / in-flight and the engine's counters, fresh from the engine (None if
    it did not answer: /get_server_info waits for the engine's next step)."""
    try:
        info = (await ctl.get("/get_server_info")).json()
        keys = ("running", "waiting", "max_num_seqs", "requests", "generated_tokens")
        return {**{k: int(info["stats"][k]) for k in keys}, "in_flight": int(info["in_flight"])}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def scraped_stats(ctl: httpx.AsyncClient) -> dict[str, float] | None:
    """The same figures from /metrics, which falls back to the last known ones when the
    engine is in a long step (what a sampler wants: an answer every time)."""
    try:
        resp = (await ctl.get("/metrics")).raise_for_status()
    except httpx.HTTPError:
        return None
    out = {}
    for line in resp.text.splitlines():
        name, _, value = line.partition("{")
        if (key := METRICS.get(name.removeprefix("tlt_serve_"))) is not None:
            out[key] = float(value.rsplit(" ", 1)[1])
    return out if len(out) == len(METRICS) else None


class ProcTree:
    """RSS and CPU of a process (with its descendants when ``tree``)."""

    def __init__(self, pid: int | None, tree: bool) -> None:
        self.root = psutil.Process(pid) if pid is not None else None
        self.tree = tree
        self._last: tuple[float, float] | None = None

    def _read(self, read: Callable[[psutil.Process], Any]) -> list[Any]:
        """``read(process)`` of every process of the tree still there."""
        try:
            procs = [] if self.root is None else [
                self.root, *(self.root.children(recursive=True) if self.tree else [])]
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                out.append(read(p))
        return out

    def rss_mb(self) -> dict[str, float]:
        """RSS per process, keyed "pid:role"."""
        return dict(self._read(lambda p: (f"{p.pid}:{self._role(p)}",
                                          p.memory_info().rss / MB)))

    def _role(self, p: psutil.Process) -> str:
        if p == self.root:
            return "main"
        cmd = " ".join(p.cmdline())
        if "resource_tracker" in cmd:
            return "resource_tracker"
        return "spawned (engine)" if "multiprocessing" in cmd else p.name()

    def cpu_pct(self) -> float | None:
        """CPU use since the previous call, in % of one core."""
        times = self._read(psutil.Process.cpu_times)
        now, last = time.monotonic(), self._last
        self._last = (now, sum(t.user + t.system for t in times))
        if last is None or now <= last[0] or not times:
            return None
        return 100.0 * (self._last[1] - last[1]) / (now - last[0])


async def settle(ctl: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
    """Waits for 0 running / 0 waiting / 0 in flight; the state reached and how long it took."""
    t0 = time.monotonic()
    while True:
        stats = await server_stats(ctl)
        empty = stats is not None and not (stats["running"] or stats["waiting"]
                                           or stats["in_flight"])
        if empty or time.monotonic() - t0 >= timeout_s:
            break
        await asyncio.sleep(0.5)
    out: dict[str, Any] = {"empty": empty, "seconds_to_empty": time.monotonic() - t0}
    if stats is not None:
        out.update(running=stats["running"], waiting=stats["waiting"],
                   in_flight=stats["in_flight"], kv_rows_used=stats["running"],
                   kv_rows=stats["max_num_seqs"],
                   kv_usage=stats["running"] / max(stats["max_num_seqs"], 1))
    return out
