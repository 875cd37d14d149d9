"""Replicas behind a real sglang-router: ``tlt-serve fleet`` on this machine, and a server
joining and leaving a running router with ``--register``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from clients.fleet import Fleet, FleetError
from tests.harness import (
    children,
    free_run,
    need_router,
    read_line,
    routed,
    running,
    tiny_flags,
    wait_for,
)
from tlt_serve.fleet.launch import split_cores
from tlt_serve.fleet.router_api import RouterApi
from tlt_serve.fleet.router_proc import RouterProcess, free_port

need_router()


@pytest.fixture
def fleet(tiny_model_dir: Path, tiny_drafter_dir: Path
          ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_run(3)  # the router's, then one per replica
    proc = subprocess.Popen(
        [sys.executable, "-m", "tlt_serve", "fleet", "--replicas", "2", "--port", str(port),
         *tiny_flags(tiny_model_dir), "--speculative", "drafter", "--drafter",
         str(tiny_drafter_dir)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # As a script waits for `tlt-serve serve`: /health, then requests at once. The router's
        # port opens only with its replicas serving, so the first request is never a 503.
        wait_for(lambda: proc.poll() is not None or _healthy(url), timeout=300, interval=0.2)
        first = httpx.post(f"{url}/generate", json={"input_ids": [5, 9], "sampling_params": {
            "max_new_tokens": 2}}, timeout=120)
        assert first.status_code == 200, first.text
        read_line(proc, "tlt-serve fleet ready")
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_cores_split_evenly_or_as_asked() -> None:
    assert split_cores([0, 1, 2, 3], 2, None) == [(0, 1), (2, 3)]
    assert split_cores([0, 1, 2, 3], 3, 1) == [(0,), (1,), (2,)]
    with pytest.raises(ValueError, match="3 replicas"):
        split_cores([0, 1], 3, None)


def test_fleet_serves_through_the_router_and_stops_cleanly(fleet) -> None:
    proc, url = fleet
    replicas = RouterApi(url).workers()
    assert len(replicas) == 2 and all(w.healthy for w in replicas)

    routed(url, 64)
    served = [httpx.get(f"{w.url}/get_server_info").json()["stats"]["requests"]
              for w in replicas]
    assert sum(served) == 64 + 1 and min(served) > 0  # both took some (+ the first request)
    assert httpx.post(f"{url}/flush_cache").json()["workers_flushed"] == 2

    kids = children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(90) == 0
    wait_for(lambda: not any(running(pid) for pid in kids), timeout=30)


def test_fleet_client_updates_every_replica(fleet, tiny_model_factory) -> None:
    _, url = fleet
    prompts = [[5, 9, 23, i + 1] for i in range(16)]
    greedy = {"max_new_tokens": 6, "temperature": 0.0}
    with Fleet(url) as f:
        assert len(f.replicas()) == 2 and f.weight_version() == "0"
        before = f.generate(prompts, n=2, **greedy)
        assert [len(g) for g in before] == [2] * 16
        with pytest.raises(FleetError, match="2 of 2") as err:
            f.update_weights_from_disk("/nonexistent/checkpoint", weight_version="bad")
        assert err.value.done == [] and len(f.replicas()) == 2  # refused everywhere: kept
        assert f.weight_version() == "0"
        other = tiny_model_factory(seed=1)
        assert f.update_weights_from_disk(str(other), weight_version="1") == "1"
        assert f.weight_version() == "1"
        after = f.generate(prompts, n=2, **greedy)
        assert all(s.weight_version == "1" for g in after for s in g)
        assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
        f.pause("in_place")
        f.resume()


def test_a_replica_killed_mid_rollout_loses_no_sample_and_rejoins_current(
    fleet, tiny_model_factory, tiny_drafter_dir: Path, tmp_path: Path
) -> None:
    proc, url = fleet
    drafter = shutil.copytree(tiny_drafter_dir, tmp_path / "published")
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    with Fleet(url) as f:
        # The fleet moves on from its start: new weights, a newly published drafter.
        assert f.update_weights_from_disk(str(tiny_model_factory(seed=2)), "w2") == "w2"
        assert f.update_drafter_from_disk(str(drafter), version=7) == 7
        replicas = f.replicas()
        prompts = [[5, 9, 23, i + 1] for i in range(64)]
        with ThreadPoolExecutor(1) as pool:
            # Long enough (64 x 192 tokens) that a loaded machine cannot finish it before the
            # poll below sees a replica running. The router may send a shared-prefix batch to
            # either replica (or all of it to one), so the victim is whichever is seen running.
            rollout = pool.submit(f.generate, prompts, n=1, max_new_tokens=192, ignore_eos=True)
            victim = wait_for(lambda: _busy(replicas) or rollout.done(), timeout=30,
                              interval=0.01)
            assert not rollout.done(), rollout.result()
            assert isinstance(victim, str)
            survivor = next(u for u in replicas if u != victim)
            pid = _pid_on(proc.pid, victim)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            groups = rollout.result(timeout=300)
        assert len(groups) == 64 and all(len(g) == 1 for g in groups)
        assert all(len(g[0].token_ids) == 192 for g in groups)  # whole samples, none partial
        # The launcher restarts it; it comes back serving what the fleet serves.
        wait_for(lambda: pid not in children(proc.pid) and _pid_on(proc.pid, victim)
                 and f.replicas() == sorted([victim, survivor]), timeout=300, interval=0.5)
        for replica in (victim, survivor):
            info = f.client(replica).drafter_info()
            assert (info["weight_version"], info["drafter_version"]) == ("w2", 7)
            assert info["drafter_path"] == str(drafter)
        alone = [f.client(u).generate(prompts[:4], **greedy) for u in (victim, survivor)]
        assert [s[0].token_ids for s in alone[0]] == [s[0].token_ids for s in alone[1]]


def _pid_on(launcher: int, url: str) -> int | None:
    """The launcher's child process serving ``url``."""
    port = url.rsplit(":", 1)[1]
    return next((p for p in children(launcher) if f"--port {port}" in _cmdline(p)), None)


def _busy(replicas: list[str]) -> str | None:
    """The first replica with requests running, if any."""
    return next((u for u in replicas if _running(u) > 0), None)


def _running(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/v1/loads", timeout=2).json()["loads"][0]["num_reqs"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_register_joins_and_leaves_a_running_router(tiny_model_dir: Path) -> None:
    router = RouterProcess("127.0.0.1", free_port(), [])
    try:
        router.wait_up()
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "tlt_serve", "serve", *tiny_flags(tiny_model_dir),
             "--port", str(port), "--register", router.url],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        try:
            read_line(server, "tlt-serve registered")
            own = f"http://127.0.0.1:{port}"
            api = RouterApi(router.url)
            api.wait_healthy([own], timeout=30)
            r = httpx.post(f"{router.url}/generate", timeout=60,
                           json={"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200, r.text
            server.send_signal(signal.SIGTERM)
            assert server.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
            assert api.workers() == []  # it left the router as it stopped
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(30)
    finally:
        router.stop()


def test_register_needs_a_reachable_url() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tlt_serve", "serve", "--host", "0.0.0.0",
         "--register", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "--advertise-url" in r.stderr
