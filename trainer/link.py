"""The trainer's HTTP link to the rollout server (the drafter endpoints of ``tlt-serve``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from safetensors.torch import load

from tlt_serve.engine.capture import TrainingSample, decode_samples, header_metadata
from tlt_serve.models.arch import ArchConfig


class LinkError(RuntimeError):
    """The server could not be reached or refused a call (the message says which)."""


@dataclass(frozen=True)
class Gate:
    train: bool
    reason: str
    weight_version: str


@dataclass(frozen=True)
class TargetTensors:
    cfg: ArchConfig
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    weight_version: str


class ServerLink:
    def __init__(
        self, url: str, api_key: str | None = None, timeout: float = 60.0, share: bool = False
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        # on the server's machine: ask for features by reference (on a GPU they stay there)
        self.share = share
        self.http = httpx.Client(base_url=url, timeout=timeout, headers=headers)
        self.cursor = 0  # the last captured sample pulled

    def restore_cursor(self, cursor: object) -> None:
        """A checkpoint's cursor (an int; anything else, e.g. a fleet's, starts over)."""
        self.cursor = cursor if isinstance(cursor, int) else 0

    @property
    def pulled(self) -> int:
        return self.cursor

    def pull(self, max_bytes: int) -> list[TrainingSample]:
        """The samples captured since the last pull (one page). A server that restarted
        numbers its samples from 1 again: then from its first."""
        samples, newest = self.samples(self.cursor, max_bytes)
        if newest < self.cursor:
            self.cursor = 0
            samples, newest = self.samples(0, max_bytes)
        if samples:
            self.cursor = samples[-1].seq
        return samples

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.HTTPError as err:
            raise LinkError(f"{method} {path}: {type(err).__name__}: {err}") from err
        if resp.status_code != 200:
            raise LinkError(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp

    def gate(self) -> Gate:
        g = self._call("GET", "/drafter/gate").json()
        return Gate(bool(g["train"]), str(g["reason"]), str(g["weight_version"]))

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._call("GET", "/get_server_info").json()
        return info

    def drafter_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._call("GET", "/get_drafter_info").json()
        return info

    def samples(self, after: int, max_bytes: int) -> tuple[list[TrainingSample], int]:
        """Samples captured after ``after`` (a page of at most ``max_bytes``) and the newest
        sequence number the server has."""
        params: dict[str, Any] = {"after": after, "max_bytes": max_bytes}
        if self.share:
            params["share"] = "true"
        resp = self._call("GET", "/drafter/samples", params=params)
        try:
            samples = decode_samples(resp.content)
        except ValueError as err:
            raise LinkError(f"GET /drafter/samples: {err}") from err
        return samples, int(resp.headers["x-newest-seq"])

    def target(self) -> TargetTensors:
        resp = self._call("GET", "/drafter/target")
        try:
            meta = header_metadata(resp.content)
            hf = json.loads(meta["config"])
            return TargetTensors(
                ArchConfig.from_hf_dict(hf), hf, load(resp.content), meta["weight_version"]
            )
        except (KeyError, ValueError) as err:
            raise LinkError(f"GET /drafter/target: malformed reply: {err!r}") from err

    def publish(self, path: str, version: int) -> str:
        """Ask the server to serve the checkpoint at ``path`` as ``version``."""
        body = {"path": path, "version": version}
        resp = self._call("POST", "/update_drafter_from_disk", json=body)
        return str(resp.json()["message"])

    def report(self, status: dict[str, Any]) -> None:
        self._call("POST", "/drafter/trainer_status", json=status)
