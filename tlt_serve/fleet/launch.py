"""``tlt-serve fleet --replicas N [serve flags]``: N replicas on this machine, each on its
own cores, and sglang-router in front of them at ``--host:--port``.

Replica i listens on ``--replica-host:port+1+i`` and is pinned to its share of the cores
this process may use (``--cores-per-replica``, default an even split), with as many torch
threads. The router comes up first with no workers; each replica is registered once it
answers ``/health``. A replica that exits is taken out of the router and started again on
its port and cores; once it answers, it gets the fleet's current weights and drafter from a
peer (``join.join_fleet``) before the router sends it requests. One that keeps dying
(``children.Life``) stays out. SIGTERM or
SIGINT stops the replicas (their in-flight requests end with partial outputs, as one
server's do), then the router.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from tlt_serve.fleet.children import START_TIMEOUT_S, Launcher, Life, die_with_parent
from tlt_serve.fleet.router_api import RouterApi
from tlt_serve.fleet.router_proc import POLICIES, RouterProcess, answers, router_missing


@dataclass(frozen=True)
class FleetArgs:
    replicas: int
    host: str
    port: int
    replica_host: str
    cores_per_replica: int | None
    policy: str
    log_level: str
    serve_flags: tuple[str, ...]


@dataclass
class Replica:
    index: int
    url: str
    cores: tuple[int, ...]
    proc: subprocess.Popen[bytes]
    life: Life


def parse(argv: list[str]) -> FleetArgs:
    p = argparse.ArgumentParser(
        prog="tlt-serve fleet",
        description="N replicas of `tlt-serve serve` behind sglang-router; other flags go to "
        "every replica",
    )
    p.add_argument("--replicas", type=int, required=True, metavar="N")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (an IP)")
    p.add_argument("--port", type=int, default=30000,
                   help="the router's port; replica i listens on port + 1 + i")
    p.add_argument("--replica-host", default="127.0.0.1")
    p.add_argument("--cores-per-replica", type=int, default=None, metavar="C")
    p.add_argument("--router-policy", choices=POLICIES, default="round_robin")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    args, serve_flags = p.parse_known_args(argv)
    if args.replicas < 1:
        p.error("argument --replicas: must be >= 1")
    if "--train-drafter" in serve_flags:
        p.error("argument --train-drafter: a fleet trains one drafter for all replicas "
                "(`tlt-train online --fleet URL`), not one per replica")
    from tlt_serve.flags import parse as parse_serve_flags

    parse_serve_flags([*serve_flags])  # the replicas' flags: exits 2 naming a bad one
    return FleetArgs(args.replicas, args.host, args.port, args.replica_host,
                     args.cores_per_replica, args.router_policy, args.log_level,
                     tuple(serve_flags))


def split_cores(cores: list[int], replicas: int, per: int | None) -> list[tuple[int, ...]]:
    """Contiguous shares of ``cores``: ``per`` each, or all of them split evenly."""
    per = per or len(cores) // replicas
    if per < 1 or per * replicas > len(cores):
        raise ValueError(f"{replicas} replicas x {per or 1} cores need more than the "
                         f"{len(cores)} cores this process may use")
    return [tuple(cores[i * per : (i + 1) * per]) for i in range(replicas)]


def start_replica(args: FleetArgs, index: int, cores: tuple[int, ...]) -> Replica:
    port = args.port + 1 + index
    cmd = [sys.executable, "-m", "tlt_serve", "serve", *args.serve_flags,
           "--host", args.replica_host, "--port", str(port), "--log-level", args.log_level]
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
    def pin() -> None:
        os.sched_setaffinity(0, cores)
        die_with_parent()

    proc = subprocess.Popen(cmd, env=env, preexec_fn=pin)
    return Replica(index, f"http://{args.replica_host}:{port}", cores, proc,
                   Life(f"replica {index}"))


class Fleet(Launcher):
    def __init__(self, args: FleetArgs) -> None:
        super().__init__()
        self.args = args
        self.router: RouterProcess | None = None
        self.replicas: list[Replica] = []

    def _start(self) -> None:
        a = self.args
        shares = split_cores(sorted(os.sched_getaffinity(0)), a.replicas, a.cores_per_replica)
        self.replicas = [start_replica(a, i, cores) for i, cores in enumerate(shares)]
        pending = {r.url for r in self.replicas}
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending and not self.stopping:
            self._check_alive()
            pending = {url for url in pending if not answers(f"{url}/health")}
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not up in {START_TIMEOUT_S:.0f} s: {sorted(pending)}")
            time.sleep(0.5)
        if not self.stopping:
            # The router's port opens only now, with every replica serving behind it: a
            # client that waits on /health (as for `serve`) never meets a fleet without one.
            urls = [r.url for r in self.replicas]
            self.router = RouterProcess(a.host, a.port, urls, a.policy, a.log_level)
            self.router.wait_up()
            RouterApi(self.router.url).wait_healthy(urls, timeout=60)
            shown = ", ".join(f"{r.url} (cores {','.join(map(str, r.cores))})"
                              for r in self.replicas)
            print(f"tlt-serve fleet ready: {self.router.url} ({a.replicas} replicas: {shown})",
                  flush=True)

    def _check_alive(self) -> None:
        for r in self.replicas:
            if r.proc.poll() is not None:
                raise RuntimeError(f"replica {r.index} ({r.url}) exited with code "
                                   f"{r.proc.returncode} while starting")

    def _supervise(self) -> None:
        assert self.router is not None
        api = RouterApi(self.router.url)
        while not self.stopping:
            if self.router.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.router.proc.returncode}")
            for r in self.replicas:
                if r.proc.poll() is not None and not r.life.left_out:
                    api.remove(r.url)
                    if r.life.died(r.url, f"exited with code {r.proc.returncode}"):
                        r.proc = start_replica(self.args, r.index, r.cores).proc
                        r.life.restarted()
                elif (r.life.joining and answers(f"{r.url}/health")
                      and not r.life.rejoin(self.router.url, r.url)):
                    r.proc.kill()  # the next pass restarts it (and counts the restart)
                    r.proc.wait()
            if all(r.life.left_out for r in self.replicas):
                raise RuntimeError("every replica keeps exiting")
            time.sleep(0.5)

    def _stop(self) -> None:
        for r in self.replicas:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas:
            try:
                r.proc.wait(60)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
        if self.router is not None:
            self.router.stop()


def main(argv: list[str]) -> int:
    if (why := router_missing()) is not None:
        print(f"tlt-serve fleet: {why}", file=sys.stderr)
        return 2
    return Fleet(parse(argv)).run()
