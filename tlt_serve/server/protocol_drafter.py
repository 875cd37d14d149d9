"""Bodies of the drafter endpoints (hot-swap, training control, capture)."""

from __future__ import annotations

from typing import Any

from msgspec import Struct


class UpdateDrafterReq(Struct, forbid_unknown_fields=True):
    path: str  # a drafter checkpoint directory (speculative/checkpoint.py)
    version: int | None = None  # overrides the checkpoint's own version


class UpdateDrafterOut(Struct):
    success: bool
    message: str
    drafter_version: int | None


class TrainerReport(Struct, forbid_unknown_fields=True):
    """What the trainer tells the server about itself (shown by /get_drafter_info)."""

    state: str  # starting | waiting | starving | training | evaluating
    pid: int | None = None  # the trainer's process
    step: int = 0
    published_version: int | None = None
    cursor: int = 0  # the last captured sample it pulled
    loss: float | None = None
    last_candidate: dict[str, Any] | None = None  # the promotion guard's last verdict
    resumed_from: str | None = None  # the checkpoint this process started from
    resumed_step: int | None = None  # that checkpoint's step


class GateOut(Struct):
    """May the trainer run now? Polled between training micro-steps."""

    train: bool
    reason: str
    in_flight: int
    max_running: int
    paused: bool
    weight_version: str
