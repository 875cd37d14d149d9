"""Online trainer checkpoints: drafter, optimizer, versions and data cursor, atomically.

``ckpt-<step>.pt`` files in the state directory, each written beside and renamed into place
(a crash mid-write leaves the previous ones intact); the newest ``KEEP`` are kept. Resuming
takes the newest readable one: a corrupt or truncated file is logged and skipped.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("trainer.state")
KEEP = 3
REQUIRED = ("drafter", "spec", "optimizer", "step", "cursor", "published_version")


def save_checkpoint(state_dir: Path, payload: dict[str, Any]) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / f"ckpt-{int(payload['step']):09d}.pt"
    tmp = state_dir / f".{path.name}.tmp"
    with tmp.open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in checkpoints(state_dir)[KEEP:]:
        old.unlink(missing_ok=True)
    return path


def checkpoints(state_dir: Path) -> list[Path]:
    """Checkpoint files, newest first."""
    return sorted(state_dir.glob("ckpt-*.pt"), reverse=True)


def load_latest(state_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint (path, payload), or None when there is none."""
    for path in checkpoints(state_dir):
        try:
            # on the CPU: a restart may train elsewhere; loading moves it to the trainer's device
            payload = torch.load(path, weights_only=True, map_location="cpu")
            missing = [k for k in REQUIRED if k not in payload]
            if missing:
                raise ValueError(f"missing {missing}")
        except Exception as err:  # any unreadable file: fall back to an older one
            log.error("trainer checkpoint %s is unusable (%s); trying an older one", path, err)
            continue
        return path, payload
    return None
