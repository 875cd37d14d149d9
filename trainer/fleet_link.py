"""The trainer's link to a fleet: every replica behind an sglang-router, as one server.

``tlt-train online --fleet ROUTER_URL`` trains one drafter for all replicas:

- replicas: the router's healthy workers, looked up again every ``refresh_s``; replicas
  come and go (a crash, a restart, a new machine) without stopping the trainer;
- gate (TLT's spot trainer): training may run while some replica is idle enough (its own
  ``/drafter/gate``) and every replica serves the same weight version. The idle replica
  lends its cores: where it runs on this machine and says which cores it has
  (``/get_server_info`` → ``cpus``), the trainer moves onto them, and moves again (or
  waits) when that replica gets work back;
- samples: pulled from every replica's capture feed, with one cursor per replica;
- target tensors: from any replica (they all serve the same weights when the gate opens);
- publish: the new drafter goes to every replica under one version; a replica that
  missed it (it was down, or joined later) gets it at the next refresh.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any
from urllib.parse import urlparse

import torch

from tlt_serve.engine.capture import TrainingSample
from tlt_serve.fleet.router_api import RouterApi, RouterError
from trainer.link import Gate, LinkError, ServerLink, TargetTensors

log = logging.getLogger("trainer.fleet")
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


class FleetLink:
    def __init__(self, router_url: str, api_key: str | None = None, timeout: float = 60.0,
                 refresh_s: float = 2.0, lend_cores: bool = True) -> None:
        self.router = RouterApi(router_url)
        self.api_key, self.timeout, self.refresh_s = api_key, timeout, refresh_s
        self.lend_cores = lend_cores
        self.links: dict[str, ServerLink] = {}
        self.cursors: dict[str, int] = {}  # kept for replicas that are away for a while
        self.published: tuple[str, int] | None = None  # (checkpoint, version) serving
        self.lender: str | None = None
        self.own_cores = sorted(os.sched_getaffinity(0))
        self.own_threads = torch.get_num_threads()
        self._listed_at = float("-inf")

    # ---- replicas ------------------------------------------------------------------------
    def replicas(self) -> list[ServerLink]:
        """Links to the router's healthy replicas (refreshed every ``refresh_s``)."""
        if time.monotonic() - self._listed_at >= self.refresh_s:
            try:
                urls = {w.url for w in self.router.workers() if w.healthy}
            except RouterError as err:
                raise LinkError(str(err)) from err
            for url in self.links.keys() - urls:
                gone = self.links.pop(url)
                self.cursors[url] = gone.cursor
                gone.close()
                log.info("replica %s left the fleet", url)
            for url in sorted(urls - self.links.keys()):
                link = ServerLink(url, self.api_key, self.timeout)
                link.cursor = self.cursors.get(url, 0)
                self.links[url] = link
                log.info("replica %s in the fleet", url)
            self._listed_at = time.monotonic()
            self._catch_up()
        if not self.links:
            raise LinkError(f"no healthy replica behind {self.router.url}")
        return [self.links[u] for u in sorted(self.links)]

    def _each(self, what: str, links: list[ServerLink], call: Any) -> dict[str, Any]:
        """``call(link)`` on each; a replica that fails is skipped (and logged) unless all
        do. The next refresh drops it if the router no longer lists it."""
        out: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for link in links:
            try:
                out[link.url] = call(link)
            except LinkError as err:
                errors[link.url] = str(err)
        for url, why in errors.items():
            log.warning("%s on %s failed: %s", what, url, why)
        if not out:
            raise LinkError(f"{what} failed on every replica: {errors}")
        return out

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self._lend(None)

    # ---- what the trainer asks -----------------------------------------------------------
    def gate(self) -> Gate:
        links = self.replicas()
        gates: dict[str, Gate] = self._each("gate", links, lambda link: link.gate())
        versions = sorted({g.weight_version for g in gates.values()})
        if len(versions) > 1:
            self._lend(None)
            return Gate(False, f"replicas serve weight versions {versions}", versions[0])
        idle = [url for url, g in gates.items() if g.train]
        if not idle:
            self._lend(None)
            return Gate(False, "every replica is busy", versions[0])
        lender = self.lender if self.lender in idle else idle[0]
        self._lend(lender)
        return Gate(True, f"{lender} is idle", versions[0])

    def drafter_info(self) -> dict[str, Any]:
        return self.replicas()[0].drafter_info()

    def target(self) -> TargetTensors:
        return self.replicas()[0].target()

    @property
    def cursor(self) -> dict[str, int]:
        """Per replica URL, the last captured sample pulled (checkpointed)."""
        return {**self.cursors, **{u: link.cursor for u, link in self.links.items()}}

    @property
    def pulled(self) -> int:
        return sum(self.cursor.values())

    def restore_cursor(self, cursor: object) -> None:
        if isinstance(cursor, dict):
            self.cursors = {str(u): int(c) for u, c in cursor.items()}
            for url, link in self.links.items():
                link.cursor = self.cursors.get(url, 0)

    def pull(self, max_bytes: int) -> list[TrainingSample]:
        """A page from every replica's feed (``max_bytes`` split between them)."""
        links = self.replicas()
        share = max(max_bytes // len(links), 1)
        pages = self._each("pull", links, lambda link: link.pull(share))
        return [s for page in pages.values() for s in page]

    def publish(self, path: str, version: int) -> str:
        self.published = (path, version)
        done = self._each("publish", self.replicas(),
                          lambda link: link.publish(path, version))
        return f"published to {len(done)} replicas"

    def report(self, status: dict[str, Any]) -> None:
        self._each("report", self.replicas(),
                   lambda link: link.report({**status, "cursor": link.cursor}))

    # ---- helpers -------------------------------------------------------------------------
    def _catch_up(self) -> None:
        """Replicas that do not serve the published drafter (down when it went out, or
        joined since) get it now."""
        if self.published is None:
            return
        path, version = self.published
        for link in self.links.values():
            try:
                if link.drafter_info().get("drafter_version") != version:
                    link.publish(path, version)
                    log.info("replica %s caught up to drafter version %d", link.url, version)
            except LinkError as err:
                log.warning("drafter catch-up on %s failed: %s", link.url, err)

    def _lend(self, url: str | None) -> None:
        """Run on the cores of the idle replica ``url`` (when it is on this machine and says
        which), or back on this process's own cores."""
        if not self.lend_cores or url == self.lender:
            return
        self.lender = url
        cores = self._cores_of(url) if url is not None else None
        cores = cores or self.own_cores
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores) if cores != self.own_cores else self.own_threads)
        log.info("training on cores %s (%s)", cores, url or "own")

    def _cores_of(self, url: str) -> list[int] | None:
        host = urlparse(url).hostname or ""
        if host not in LOCAL_HOSTS and host != socket.gethostname():
            return None
        try:
            info = self.links[url].server_info()
        except (LinkError, KeyError):
            return None
        usable = set(self.own_cores)
        cores = [c for c in info.get("cpus") or [] if c in usable]
        return cores or None
