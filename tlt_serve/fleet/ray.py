"""``python -m tlt_serve.fleet.ray --replicas N [serve flags]``: a tlt-serve fleet on a Ray
cluster, for RL frameworks that already run on Ray (verl, OpenRLHF, slime).

It joins a running cluster (``--address``, default ``auto``; ``--address local`` starts a
private one for this process, like ``ray.init()``). Each replica is a small Ray actor holding
``--cpus-per-replica`` CPUs and ``--gpus-per-replica`` GPUs (Ray sets its
``CUDA_VISIBLE_DEVICES``); the actor runs ``python -m tlt_serve serve <flags> --host <its node's
IP> --port <a free port there>`` with as many torch threads as CPUs. Actors are spread over
the nodes (SPREAD); ``--one-per-node`` asks for a STRICT_SPREAD placement group instead, so
the start fails rather than put two replicas on one node. Give a replica one GPU for one
replica per GPU.

sglang-router runs on this (the driver's) node at ``--host:--port`` with no workers; each
replica is registered once it answers ``/health``. A replica whose process exits, or whose
actor or node dies, is taken out of the router and started again in a new actor (placed as
the first was, so maybe on another node, on another port); once it answers, it gets the
fleet's current weights and drafter from a peer (``join.join_fleet``) before the router
sends it requests. One that keeps dying stays out (``children.Life``). The replica process
gets SIGTERM when its actor's process dies, so a lost driver or actor leaves no replica
behind. SIGTERM or SIGINT stops
the replicas (SIGTERM through their actors), kills the actors, then stops the router and
exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tlt_serve.fleet.children import START_TIMEOUT_S, Launcher, Life, die_with_parent, say
from tlt_serve.fleet.router_api import RouterApi
from tlt_serve.fleet.router_proc import POLICIES, RouterProcess, answers, free_port, router_missing

RAY_INSTALL = "pip install ray==2.60.0 (or the ray extra)"


@dataclass(frozen=True)
class RayFleetArgs:
    replicas: int
    address: str
    cpus: int
    gpus: float
    one_per_node: bool
    host: str | None  # None: this node's IP as Ray sees it
    port: int
    policy: str
    log_level: str
    serve_flags: tuple[str, ...]


def parse(argv: list[str]) -> RayFleetArgs:
    p = argparse.ArgumentParser(
        prog="python -m tlt_serve.fleet.ray",
        description="N replicas of `tlt-serve serve` as Ray actors behind sglang-router; "
        "other flags go to every replica",
    )
    p.add_argument("--replicas", type=int, required=True, metavar="N")
    p.add_argument("--address", default="auto",
                   help="the Ray cluster (ray.init's address); 'local' starts one here")
    p.add_argument("--cpus-per-replica", type=int, default=1, metavar="C")
    p.add_argument("--gpus-per-replica", type=float, default=0.0, metavar="G")
    p.add_argument("--one-per-node", action="store_true",
                   help="at most one replica per node (a STRICT_SPREAD placement group)")
    p.add_argument("--host", default=None,
                   help="the router's address (an IP); default: this node's IP in the cluster")
    p.add_argument("--port", type=int, default=30000, help="the router's port")
    p.add_argument("--router-policy", choices=POLICIES, default="round_robin")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    args, serve_flags = p.parse_known_args(argv)
    if args.replicas < 1:
        p.error("argument --replicas: must be >= 1")
    if args.cpus_per_replica < 1 or args.gpus_per_replica < 0:
        p.error("--cpus-per-replica must be >= 1 and --gpus-per-replica >= 0")
    if "--train-drafter" in serve_flags:
        p.error("argument --train-drafter: a fleet trains one drafter for all replicas "
                "(`tlt-train online --fleet URL`), not one per replica")
    from tlt_serve.flags import parse as parse_serve_flags

    parse_serve_flags([*serve_flags])  # the replicas' flags: exits 2 naming a bad one
    return RayFleetArgs(args.replicas, args.address, args.cpus_per_replica,
                        args.gpus_per_replica, args.one_per_node, args.host, args.port,
                        args.router_policy, args.log_level, tuple(serve_flags))


class ReplicaProcess:
    """One ``tlt-serve serve`` on the node this actor was placed on."""

    def __init__(self, serve_flags: list[str], cpus: int, log_level: str) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self._url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "tlt_serve", "serve", *serve_flags,
               "--host", host, "--port", str(port), "--log-level", log_level]
        env = {**os.environ, "OMP_NUM_THREADS": str(cpus)}
        # The parent-death signal follows the thread that forks: only the main one lives on.
        main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent if main else None)

    def url(self) -> str:
        return self._url

    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        """None while the replica runs."""
        return self.proc.poll()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class Replica:
    index: int
    opts: dict[str, Any]  # its actor's Ray options: resources and placement
    actor: Any = None  # a ray ActorHandle of ReplicaProcess
    url: str = ""  # "" until the actor is placed and has started the replica
    pid: int = 0  # the replica process's, on its node
    life: Life = field(default_factory=lambda: Life("replica"))


class RayFleet(Launcher):
    def __init__(self, args: RayFleetArgs) -> None:
        super().__init__()
        self.args = args
        self.router: RouterProcess | None = None
        self.replicas: list[Replica] = []
        self.pg: Any = None
        self.actor_cls: Any = None

    def run(self) -> int:
        import ray

        try:
            ray.init(address=self.args.address, log_to_driver=True)
        except ConnectionError as err:
            say(f"no Ray cluster at {self.args.address!r}: {err}")
            return 1
        try:  # the signal handlers go in after ray.init, which sets its own
            return super().run()
        finally:
            ray.shutdown()

    def _place(self) -> list[dict[str, Any]]:
        """Each actor's Ray options; raises ValueError when the cluster is too small."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        a = self.args
        total = ray.cluster_resources()
        need = {"CPU": float(a.cpus * a.replicas), "GPU": a.gpus * a.replicas}
        short = [f"{need[k]:g} {k}s (the cluster has {total.get(k, 0):g})"
                 for k in need if need[k] > total.get(k, 0)]
        if short:
            raise ValueError(f"{a.replicas} replicas need {', '.join(short)}")
        res = {"num_cpus": a.cpus, "num_gpus": a.gpus, "max_restarts": 0}
        if not a.one_per_node:
            return [{**res, "scheduling_strategy": "SPREAD"}] * a.replicas
        bundle = {"CPU": float(a.cpus), **({"GPU": a.gpus} if a.gpus else {})}
        self.pg = ray.util.placement_group([bundle] * a.replicas, strategy="STRICT_SPREAD")
        if not self._ready(self.pg.ready(), 60):
            raise ValueError(f"no {a.replicas} distinct nodes with {bundle} free each "
                             "(--one-per-node) in 60 s")
        return [{**res, "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, i)}
                for i in range(a.replicas)]

    def _ready(self, ref: Any, timeout: float) -> bool:
        """Waits for ``ref`` in short steps, so that a signal ends the wait."""
        import ray

        deadline = time.monotonic() + timeout
        while not self.stopping and time.monotonic() < deadline:
            if ray.wait([ref], timeout=min(0.5, timeout))[0]:
                return True
        return False

    def _spawn(self, r: Replica) -> None:
        a = self.args
        r.actor = self.actor_cls.options(**r.opts).remote(list(a.serve_flags), a.cpus,
                                                          a.log_level)
        r.url, r.pid, r.life.started = "", 0, time.monotonic()

    def _located(self, r: Replica) -> bool:
        """Whether the replica's actor runs and has said where its replica listens."""
        import ray

        if not r.url and self._ready(r.actor.url.remote(), 0.1):
            try:
                r.url, r.pid = ray.get([r.actor.url.remote(), r.actor.pid.remote()])
            except ray.exceptions.RayActorError:
                r.url = "(not started)"  # _gone says why
        return bool(r.url)

    def _start(self) -> None:
        import ray

        a = self.args
        host = a.host or ray.util.get_node_ip_address()
        self.actor_cls = ray.remote(ReplicaProcess)
        self.replicas = [Replica(i, opts, life=Life(f"replica {i}"))
                         for i, opts in enumerate(self._place())]
        for r in self.replicas:
            self._spawn(r)
        pending = {r.index for r in self.replicas}
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending and not self.stopping:
            for r in self.replicas:
                if r.index not in pending or not self._located(r):
                    continue  # up, or not placed yet
                if (how := self._gone(r)) is not None:
                    raise RuntimeError(f"replica {r.index} ({r.url}) {how} while starting")
                if answers(f"{r.url}/health"):
                    pending.discard(r.index)
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not up in {START_TIMEOUT_S:.0f} s: "
                                   f"{sorted(self.replicas[i].url or i for i in pending)}")
            time.sleep(0.5)
        if not self.stopping:
            # The router's port opens only once every replica serves (as `tlt-serve fleet`).
            urls = [r.url for r in self.replicas]
            self.router = RouterProcess(host, a.port, urls, a.policy, a.log_level)
            self.router.wait_up()
            RouterApi(self.router.url).wait_healthy(urls, timeout=60)
            shown = ", ".join(f"{r.url} (pid {r.pid})" for r in self.replicas)
            print(f"tlt-serve fleet ready: {self.router.url} ({a.replicas} replicas: {shown})",
                  flush=True)

    def _gone(self, r: Replica) -> str | None:
        """How the replica ended ("exited with code 1", "its actor died ..."); None while it
        runs."""
        import ray

        try:
            code = ray.get(r.actor.exit_code.remote(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            return None  # a busy actor is not a dead one
        except ray.exceptions.RayActorError as err:
            return f"its actor died ({type(err).__name__})"
        return None if code is None else f"exited with code {code}"

    def _supervise(self) -> None:
        assert self.router is not None
        api = RouterApi(self.router.url)
        while not self.stopping:
            if self.router.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.router.proc.returncode}")
            for r in self.replicas:
                if r.life.left_out or not self._located(r):
                    continue  # left out, or its new actor is not placed yet
                if (how := self._gone(r)) is not None:
                    self._restart(api, r, how)
                elif (r.life.joining and answers(f"{r.url}/health")
                      and not r.life.rejoin(self.router.url, r.url, f"{r.url} (pid {r.pid})")):
                    self._restart(api, r, "could not rejoin")
            if all(r.life.left_out for r in self.replicas):
                raise RuntimeError("every replica keeps exiting")
            time.sleep(0.5)

    def _restart(self, api: RouterApi, r: Replica, how: str) -> None:
        import ray

        api.remove(r.url)
        ray.kill(r.actor)  # a replica whose actor lives on still holds its resources
        if r.life.died(r.url, how):
            self._spawn(r)
            r.life.restarted()

    def _stop(self) -> None:
        import ray

        live = [r for r in self.replicas if r.actor is not None]
        stops = [r.actor.stop.remote() for r in live]  # a dead one's ref holds its error
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=90)
        for r in live:
            ray.kill(r.actor)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
        if self.router is not None:
            self.router.stop()


def main(argv: list[str]) -> int:
    import importlib.util

    if (why := router_missing()) is not None:
        print(f"tlt-serve fleet: {why}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("ray") is None:
        print(f"tlt-serve fleet: the Ray fleet needs ray: {RAY_INSTALL}", file=sys.stderr)
        return 2
    return RayFleet(parse(argv)).run()


if __name__ == "__main__":
    # Through the module's own name, so that Ray pickles the actor class by reference.
    from tlt_serve.fleet.ray import main as _main

    sys.exit(_main(sys.argv[1:]))
