"""The runtime worker API of a running sglang-router (0.3.x), over HTTP.

Workers are registered with ``POST /workers {"url"}`` (202: the router probes the worker's
``/health`` and server info in the background, and adds it once healthy), listed with
``GET /workers`` and removed with ``DELETE /workers/{id}``, where the id is the router's
UUID for the worker, not its URL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Worker:
    id: str  # the router's UUID for it
    url: str
    healthy: bool


class RouterError(RuntimeError):
    pass


class RouterApi:
    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, **kw: object) -> httpx.Response:
        try:
            r = httpx.request(method, f"{self.url}{path}", timeout=self.timeout, **kw)  # type: ignore[arg-type]
        except httpx.HTTPError as err:
            raise RouterError(f"router {self.url} unreachable: {err}") from err
        if r.status_code >= 400:
            raise RouterError(f"router {self.url}{path}: HTTP {r.status_code}: {r.text[:200]}")
        return r

    def workers(self) -> list[Worker]:
        """The registered workers (a worker still being probed is not listed yet)."""
        listed = self._call("GET", "/workers").json().get("workers", [])
        return [Worker(w["id"], w["url"].rstrip("/"), bool(w.get("is_healthy"))) for w in listed]

    def add(self, url: str, api_key: str | None = None) -> None:
        """Ask the router to add ``url``; it joins once its ``/health`` answers. ``api_key``:
        the worker's, which the router then sends it."""
        body = {"url": url, **({"api_key": api_key} if api_key else {})}
        self._call("POST", "/workers", json=body)

    def remove(self, url: str) -> bool:
        """Remove ``url``; False when the router does not list it."""
        for w in self.workers():
            if w.url == url.rstrip("/"):
                self._call("DELETE", f"/workers/{w.id}")
                return True
        return False

    def wait_healthy(self, urls: list[str], timeout: float) -> None:
        """Until every url is registered and healthy; RouterError naming the others."""
        want = {u.rstrip("/") for u in urls}
        deadline = time.monotonic() + timeout
        while True:
            try:
                healthy = {w.url for w in self.workers() if w.healthy}
            except RouterError:
                healthy = set()
            if want <= healthy:
                return
            if time.monotonic() > deadline:
                raise RouterError(f"not healthy behind {self.url} after {timeout:.0f} s: "
                                  f"{', '.join(sorted(want - healthy))}")
            time.sleep(0.2)
