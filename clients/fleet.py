"""A fleet of tlt-serve replicas behind sglang-router, with ``Client``'s methods.

    with Fleet("http://127.0.0.1:30000") as fleet:          # the router's URL
        groups = fleet.generate(prompts, n=8, max_new_tokens=256, return_logprob=True)
        fleet.update_weights_from_disk("/ckpt/step-3", weight_version="3")

Generation goes through the router, one request per prompt (its n samples share a prefill
on one replica), ``max_parallel`` at a time. The router resends a request that meets a dead
replica; one that still fails (connection error, 5xx) is sent again here, up to ``retries``
times, under a fresh rid: every prompt gets exactly one group back, never two.

The router forwards only ``/flush_cache`` to every worker, so control calls (weights, pause
and continue, aborts, drafters) go from here to each replica the router lists as healthy,
in parallel. A weight update returns only when every replica reports the same
``weight_version``. If every replica refuses it (a malformed update), all keep serving the
old weights. If only some fail it, the others keep the new weights (there is no way back to
the old ones) and the failed ones are taken out of the router, so the fleet never serves two
versions at once; ``FleetError`` names them. ``rejoin(url)`` copies the fleet's weights
and drafter to a replica, then puts it back.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import torch

from clients.client import Client
from clients.results import Sample, ServerError
from tlt_serve.fleet.join import Joined, JoinError, join_fleet
from tlt_serve.fleet.router_api import RouterApi, RouterError

T = TypeVar("T")


class FleetError(RuntimeError):
    """Some replicas did not take a control call: ``failed`` maps their URL to the reason;
    ``done`` lists the ones that did."""

    def __init__(self, what: str, failed: Mapping[str, str], done: Sequence[str]) -> None:
        shown = "; ".join(f"{url}: {why}" for url, why in failed.items())
        super().__init__(f"{what} failed on {len(failed)} of {len(failed) + len(done)} "
                         f"replicas ({shown})")
        self.failed, self.done = dict(failed), list(done)


class Fleet:
    def __init__(self, router_url: str, api_key: str | None = None, timeout: float = 3600.0,
                 max_parallel: int = 256, retries: int = 3) -> None:
        self.router = RouterApi(router_url)
        self.api_key, self.timeout, self.retries = api_key, timeout, retries
        self.routed = Client(router_url, api_key, timeout)
        self.pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="fleet")
        self.clients: dict[str, Client] = {}

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.routed.close()
        for c in self.clients.values():
            c.close()

    # ---- replicas ------------------------------------------------------------------------
    def replicas(self) -> list[str]:
        """URLs of the replicas the router routes to now (registered and healthy)."""
        return sorted(w.url for w in self.router.workers() if w.healthy)

    def client(self, url: str) -> Client:
        if url not in self.clients:
            self.clients[url] = Client(url, self.api_key, self.timeout)
        return self.clients[url]

    def each(self, what: str, call: Callable[[Client], T]) -> dict[str, T]:
        """``call`` on every replica in parallel; FleetError naming any that failed."""
        urls = self.replicas()
        if not urls:
            raise FleetError(what, {self.router.url: "no healthy replica behind the router"}, [])
        futures = {u: self.pool.submit(call, self.client(u)) for u in urls}
        done: dict[str, T] = {}
        failed: dict[str, str] = {}
        for url, fut in futures.items():
            try:
                done[url] = fut.result()
            except (ServerError, httpx.HTTPError) as err:
                failed[url] = str(err) or type(err).__name__
        if failed:
            raise FleetError(what, failed, list(done))
        return done

    def rejoin(self, url: str) -> Joined:
        """Put a replica back behind the router, first copying the fleet's weights and
        drafter to it from a healthy peer (``tlt_serve.fleet.join``)."""
        try:
            return join_fleet(self.router.url, url, api_key=self.api_key)
        except (JoinError, RouterError) as err:
            raise FleetError("rejoin", {url: str(err)}, []) from err

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int = 1, return_logprob: bool = False,
        **sampling: Any,
    ) -> list[list[Sample]]:
        """One group of ``n`` samples per prompt, in order, each from one replica."""
        futures = [self.pool.submit(self._one, p, n, return_logprob, sampling) for p in prompts]
        return [f.result() for f in futures]

    def _one(self, prompt: Sequence[int], n: int, return_logprob: bool,
             sampling: Mapping[str, Any]) -> list[Sample]:
        attempt = 0
        while True:
            try:
                return self.routed.generate([prompt], n, return_logprob, **sampling)[0]
            except (ServerError, httpx.TransportError) as err:
                client_error = isinstance(err, ServerError) and err.status < 500
                if client_error or attempt == self.retries:
                    raise
                attempt += 1

    # ---- control, on every replica -------------------------------------------------------
    def abort(self, rid: str | None = None) -> None:
        """Abort one request (on whichever replica runs it) or all of them."""
        self.each("abort", lambda c: c.abort(rid))

    def pause(self, mode: str = "abort") -> None:
        self.each("pause", lambda c: c.pause(mode))

    def resume(self) -> None:
        self.each("resume", lambda c: c.resume())

    def flush_cache(self) -> None:
        self.each("flush_cache", lambda c: c._post("/flush_cache", {}))

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> str:
        """Every replica loads ``path``; returns the version they all serve."""
        return self._update("update_weights_from_disk",
                            lambda c: c.update_weights_from_disk(path, weight_version))

    def update_weights_from_tensors(
        self, tensors: Mapping[str, torch.Tensor], weight_version: str | None = None
    ) -> str:
        """Every replica gets the tensors (one upload each); returns the common version."""
        upload = f"fleet-{uuid.uuid4().hex[:8]}"
        return self._update("update_weights_from_tensors",
                            lambda c: c.update_weights_from_tensors(tensors, weight_version,
                                                                    upload_id=upload))

    def update_drafter_from_disk(self, path: str, version: int | None = None) -> int:
        """Every replica serves the drafter at ``path`` under one version; returns it."""
        body = {"path": path, **({"version": version} if version is not None else {})}
        replies = self.each("update_drafter_from_disk",
                            lambda c: c._post("/update_drafter_from_disk", body))
        versions = {int(r["drafter_version"]) for r in replies.values()}
        if len(versions) != 1:
            raise FleetError("update_drafter_from_disk", {
                u: f"serves drafter version {r['drafter_version']}" for u, r in replies.items()},
                [])
        return versions.pop()

    def _update(self, what: str, call: Callable[[Client], dict]) -> str:
        try:
            replies = self.each(what, call)
        except FleetError as err:
            if err.done:  # some took it: stale weights must not serve beside the new ones
                for url in err.failed:
                    self.router.remove(url)
            raise
        versions = {str(r["weight_version"]) for r in replies.values()}
        if len(versions) != 1:
            raise FleetError(what, {u: f"now at weight version {r['weight_version']!r}"
                                    for u, r in replies.items()}, [])
        return versions.pop()

    def weight_version(self) -> str:
        """The version every replica serves; FleetError if they differ."""
        versions = self.each("weight_version", lambda c: c.weight_version())
        if len(set(versions.values())) != 1:
            raise FleetError("weight_version", {u: f"serves {v!r}" for u, v in versions.items()},
                             [])
        return next(iter(versions.values()))

    def health(self) -> dict[str, bool]:
        return {w.url: w.healthy for w in self.router.workers()}
