"""Bring a replica to what the fleet serves, then put it behind the router.

A replica that starts (or restarts after a crash) serves the weights and drafter it was
started with, while the fleet may have moved on: RL weight updates, drafters published by
the fleet trainer. ``join_fleet`` copies both from a healthy peer before the router sends
the replica any request:

- weights: the peer's served weights (``GET /get_weights``: safetensors, HF names, served
  dtype) are uploaded to the replica under the peer's ``weight_version``, so the replica
  serves bit for bit what the peer serves (native backend; a vLLM peer cannot export);
- drafter: the checkpoint the peer serves (``drafter_path`` of ``/get_drafter_info``, on a
  file system both see, as published drafters are) under the peer's ``drafter_version``.

A weight update fanned out while the replica joins may miss it (it is not listed yet): after
the router lists it, its versions are compared with the peer's again and the copy is redone
(up to ``rounds`` times) until they agree.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import httpx

from tlt_serve.fleet.router_api import RouterApi

log = logging.getLogger("tlt_serve.fleet")


class JoinError(RuntimeError):
    """The replica could not be brought to the fleet's state (the message says why)."""


@dataclass(frozen=True)
class Joined:
    url: str
    peer: str | None  # None: the first replica, nothing to copy
    weight_version: str
    drafter_version: int | None
    copied_weights: bool
    copied_drafter: bool


class _Http:
    def __init__(self, api_key: str | None, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout)

    def __enter__(self) -> _Http:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def get(self, url: str) -> Any:
        return self._ok(self.http.get(url), url).json()

    def post(self, url: str, **kw: Any) -> Any:
        return self._ok(self.http.post(url, **kw), url).json()

    @staticmethod
    def _ok(resp: httpx.Response, url: str) -> httpx.Response:
        if resp.status_code != 200:
            raise JoinError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp

    def versions(self, url: str) -> tuple[str, int | None, str | None]:
        """(weight version, drafter version, drafter checkpoint) a replica serves."""
        info = self.get(f"{url}/get_drafter_info")
        return str(info["weight_version"]), info.get("drafter_version"), info.get("drafter_path")


def sync_from(peer: str, url: str, api_key: str | None = None,
              timeout: float = 600.0) -> Joined:
    """Make the replica at ``url`` serve the weights and drafter ``peer`` serves."""
    with _Http(api_key, timeout) as http:
        return _sync(http, peer, url)


def _sync(http: _Http, peer: str, url: str) -> Joined:
    try:
        want_w, want_d, path = http.versions(peer)
        have_w, have_d, _ = http.versions(url)
        copied_w = have_w != want_w
        if copied_w:
            _copy_weights(http, peer, url)
        copied_d = want_d is not None and have_d != want_d
        if copied_d:
            if not path:
                raise JoinError(f"{peer} serves drafter version {want_d} but does not say "
                                "from which checkpoint")
            reply = http.post(f"{url}/update_drafter_from_disk",
                              json={"path": path, "version": want_d})
            if int(reply["drafter_version"]) != want_d:
                raise JoinError(f"{url} took drafter {path} as version "
                                f"{reply['drafter_version']}, not {want_d}")
        return Joined(url, peer, want_w, want_d, copied_w, copied_d)
    except httpx.HTTPError as err:
        raise JoinError(f"copying from {peer} to {url}: {type(err).__name__}: {err}") from err


def _copy_weights(http: _Http, peer: str, url: str) -> None:
    fd, name = tempfile.mkstemp(prefix="tlt-join-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f, http.http.stream("GET", f"{peer}/get_weights") as resp:
            if resp.status_code != 200:
                raise JoinError(f"{peer}/get_weights: HTTP {resp.status_code}: "
                                f"{resp.read()[:300]!r}")
            version = resp.headers["x-weight-version"]
            for piece in resp.iter_bytes(1 << 20):
                f.write(piece)
        with open(name, "rb") as body:
            reply = http.post(f"{url}/update_weights_from_tensor",
                              params={"weight_version": version}, content=body)
        if str(reply["weight_version"]) != version:
            raise JoinError(f"{url} took {peer}'s weights as version "
                            f"{reply['weight_version']!r}, not {version!r}")
    finally:
        os.unlink(name)


def join_fleet(router_url: str, url: str, api_key: str | None = None,
               timeout: float = 600.0, rounds: int = 3) -> Joined:
    """Copy the fleet's weights and drafter to ``url`` from a healthy peer, then add it to
    the router; returns once the router lists it healthy and its versions are the peer's."""
    router = RouterApi(router_url)
    url = url.rstrip("/")
    joined: Joined | None = None
    with _Http(api_key, timeout) as http:
        for _ in range(rounds):
            peers = sorted(w.url for w in router.workers() if w.healthy and w.url != url)
            if peers:
                joined = _sync(http, peers[0], url)
            else:
                w, d, _ = http.versions(url)
                joined = Joined(url, None, w, d, False, False)
            router.add(url, api_key=api_key)
            router.wait_healthy([url], timeout=60)
            if joined.peer is None or http.versions(joined.peer)[:2] == http.versions(url)[:2]:
                log.info("joined %s: %s", router_url, joined)
                return joined
            router.remove(url)  # an update went out meanwhile: copy again
    raise JoinError(f"{url}: the fleet's versions kept changing while it joined "
                    f"({rounds} rounds); last copy {joined}")
