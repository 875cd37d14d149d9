"""Weight pushes over torch.distributed: the RL trainer is rank 0 of a group with the server.

    pusher = DistributedPusher(client, "127.0.0.1", 29555)   # joins the server's group
    pusher.push(model.named_parameters(), weight_version="7")  # broadcast, applied all-or-none
    pusher.close()

The server's /init_weights_update_group and /update_weights_from_distributed calls block
until rank 0 takes part, so each runs in a helper thread while this process joins / sends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from clients.client import Client
from tlt_serve.weight_sync import WeightSyncGroup, specs_of


class DistributedPusher:
    def __init__(self, client: Client, master_address: str, master_port: int,
                 group_name: str = "rl", backend: str = "gloo", timeout_s: float = 120.0):
        self.client, self.group_name, self.timeout_s = client, group_name, timeout_s
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": 1, "world_size": 2, "group_name": group_name,
                "backend": backend}
        call = self._background("/init_weights_update_group", body)
        self.group = WeightSyncGroup(master_address, master_port, 0, 2, backend,
                                     timeout_s=timeout_s)
        self._finish(call)

    def _background(self, path: str, body: dict) -> tuple[threading.Thread, dict[str, Any]]:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["reply"] = self.client._post(path, body)
            except Exception as err:  # re-raised in the caller's thread
                box["error"] = err

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, box

    def _finish(self, call: tuple[threading.Thread, dict[str, Any]]) -> dict[str, Any]:
        thread, box = call
        thread.join(self.timeout_s)
        if "error" in box:
            raise box["error"]
        if "reply" not in box:
            raise TimeoutError("the server did not answer in time")
        return dict(box["reply"])

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]],
             weight_version: str | None = None) -> dict[str, Any]:
        """Broadcast HF-named tensors; the server applies them all or none."""
        named = [(n, t.detach().contiguous()) for n, t in tensors]
        specs = specs_of(named)
        call = self._background("/update_weights_from_distributed", {
            "names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs], "weight_version": weight_version,
            "group_name": self.group_name})
        self.group.send(named)
        return self._finish(call)

    def close(self) -> None:
        self.client._post("/destroy_weights_update_group", {"group_name": self.group_name})
