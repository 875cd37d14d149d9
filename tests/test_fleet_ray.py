"""``python -m tlt_serve.fleet.ray``: replicas as Ray actors on a real (one-node, local) Ray
cluster, behind a real sglang-router.

The cluster is this module's own: ``ray start --head`` in its own process group and temp
dir, ended by signalling that group (``ray stop`` would end every Ray on the machine)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.harness import (
    DEV,
    free_run,
    group,
    need,
    need_router,
    read_line,
    routed,
    running,
    tiny_flags,
    wait_for,
)
from tlt_serve.fleet.router_api import RouterApi
from tlt_serve.fleet.router_proc import free_port

need_router()
need("ray", DEV, "TLT_REQUIRE_RAY")

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


def _end_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            wait_for(lambda: not group(pgid), timeout=15, interval=0.2)
            return
        except AssertionError:
            continue


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A one-node Ray cluster with 2 CPUs and a small object store."""
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a limit
    port = free_run(1)
    head = subprocess.Popen(
        [*RAY, "start", "--head", "--num-cpus", "2", "--port", str(port),
         "--dashboard-port", str(free_port()), "--include-dashboard=false",
         "--disable-usage-stats", "--object-store-memory", "100000000", "--temp-dir", tmp],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # every Ray process stays in this group
    )
    try:
        out, _ = head.communicate(timeout=120)
        assert head.returncode == 0, out
        address = re.search(r"--address='([^']+)'", out)
        assert address, out
        yield address.group(1)
    finally:
        _end_group(head.pid)
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class RayFleetProc:
    proc: subprocess.Popen[str]
    url: str
    replicas: dict[str, int]  # url -> pid
    stderr: Path


@pytest.fixture
def ray_fleet(ray_address: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[RayFleetProc]:
    err = tmp_path / "stderr"
    replicas: dict[str, int] = {}
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tlt_serve.fleet.ray", "--address", ray_address,
             "--replicas", "2", "--cpus-per-replica", "1", "--port", str(free_run(1)),
             *tiny_flags(tiny_model_dir)],
            env=ENV, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
        )
    try:
        ready = read_line(proc, "tlt-serve fleet ready", timeout=400)
        found = re.fullmatch(r"tlt-serve fleet ready: (\S+) \(2 replicas: (.*)\)\n", ready)
        assert found, ready
        replicas.update((u, int(p)) for u, p in re.findall(r"(http://\S+) \(pid (\d+)\)", found[2]))
        assert len(replicas) == 2, ready
        yield RayFleetProc(proc, found[1], replicas, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        # Replicas the launcher did not stop (it failed, or was killed above) end here.
        for pid in (p for p in replicas.values() if running(p)):
            os.kill(pid, signal.SIGKILL)


def _served(url: str) -> int:
    return int(httpx.get(f"{url}/get_server_info", timeout=10).json()["stats"]["requests"])


def test_ray_fleet_serves_through_the_router_and_stops_cleanly(ray_fleet: RayFleetProc) -> None:
    f = ray_fleet
    workers = RouterApi(f.url).workers()
    assert {w.url for w in workers} == set(f.replicas) and all(w.healthy for w in workers)
    routed(f.url, 32)
    served = [_served(u) for u in f.replicas]
    assert sum(served) == 32 and min(served) > 0  # both replicas took requests

    os.killpg(f.proc.pid, signal.SIGTERM)
    assert f.proc.wait(120) == 0
    wait_for(lambda: not any(running(p) for p in f.replicas.values()), timeout=30)
    assert not group(f.proc.pid)  # the router too


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _rejoined(f: RayFleetProc, index: int, after: int) -> tuple[str, int]:
    """The URL and pid replica ``index`` rejoined as, in a line past ``after`` characters of
    the launcher's stderr."""
    pattern = rf"replica {index} rejoined as (\S+) \(pid (\d+)\)"
    found = wait_for(lambda: re.search(pattern, f.stderr.read_text()[after:]), timeout=120,
                     interval=0.2)
    return found[1], int(found[2])


def test_a_dead_replica_leaves_the_router_and_rejoins_restarted(ray_fleet: RayFleetProc) -> None:
    f = ray_fleet
    (victim, pid), (survivor, survivor_pid) = sorted(f.replicas.items())
    index = list(f.replicas).index(victim)  # the launcher numbers them as the ready line lists
    os.kill(pid, signal.SIGKILL)
    said = f"replica {index} ({victim}) exited with code -9; taken out of the router and restarted"
    wait_for(lambda: said in f.stderr.read_text(), timeout=30, interval=0.2)
    assert victim not in {w.url for w in RouterApi(f.url).workers()}
    before = _served(survivor)
    routed(f.url, 16)  # the other replica serves meanwhile
    assert _served(survivor) > before

    new, new_pid = _rejoined(f, index, 0)
    assert new_pid != pid and running(new_pid)
    wait_for(lambda: {w.url for w in RouterApi(f.url).workers() if w.healthy} == {survivor, new},
             timeout=30, interval=0.2)
    routed(f.url, 16)
    assert _served(new) > 0

    # The other replica's actor dies: its replica goes with it, and a new one rejoins.
    seen = len(f.stderr.read_text())
    os.kill(_ppid(survivor_pid), signal.SIGKILL)
    wait_for(lambda: not running(survivor_pid), timeout=30, interval=0.2)
    other, other_pid = _rejoined(f, 1 - index, seen)
    assert f"({survivor}) its actor died" in f.stderr.read_text()[seen:]
    wait_for(lambda: {w.url for w in RouterApi(f.url).workers() if w.healthy} == {new, other},
             timeout=30, interval=0.2)
    routed(f.url, 8)

    os.killpg(f.proc.pid, signal.SIGTERM)
    assert f.proc.wait(120) == 0
    wait_for(lambda: not any(running(p) for p in (new_pid, other_pid)), timeout=30)
