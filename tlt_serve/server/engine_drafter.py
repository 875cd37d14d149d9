"""Drafter-related control handlers of the engine process (run between two engine steps).

- ``update_drafter_from_disk``: validate a checkpoint and serve it from the next step;
- ``drafter_info``: serving drafter, recent accept length, capture buffer;
- ``capture_take``: captured training samples after a cursor (safetensors blob);
- ``drafter_target``: what a trainer borrows from the target (embedding, final norm, head,
  HF config) at the current weight version (safetensors blob).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from safetensors.torch import save

from tlt_serve.capture import encode_samples
from tlt_serve.engine.engine import Engine
from tlt_serve.server.engine_weights import ControlError

MAX_TAKE_BYTES = 256 << 20  # one capture_take reply at most (the pipe holds it whole)


class DrafterControls:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def handlers(self) -> dict[str, Callable[..., dict[str, Any]]]:
        return {
            "update_drafter_from_disk": self.from_disk,
            "drafter_info": self.info,
            "capture_take": self.take,
            "drafter_target": self.target,
        }

    def from_disk(self, path: str, version: int | None = None) -> dict[str, Any]:
        """Never raises for a bad checkpoint: the reply says whether it was applied and which
        drafter serves now (the route answers 400 when not)."""
        result = self.engine.update_drafter(path, version)
        return {"success": result.ok, "message": result.message,
                "drafter_version": result.drafter_version}

    def info(self) -> dict[str, Any]:
        spec, stats = self.engine.spec, self.engine.stats
        drafter = spec.drafter
        return {
            "drafter_version": spec.drafter_version,
            "drafter_path": self.engine.drafter_path,
            "feature_layers": list(spec.feature_layers),
            "draft_vocab_size": None if drafter is None else drafter.spec.draft_vocab_size,
            "sliced_head": True,  # a checkpoint's draft_vocab restricts the drafts
            "target_weight_version": None
            if drafter is None
            else drafter.spec.target_weight_version,
            "weight_version": self.engine.weight_version,
            "recent_accept_length": round(stats.recent_accept_length, 4),
            "recent_verify_steps": len(stats.recent_spec),
            "capture": dataclasses.asdict(self.engine.capture.stats()),
        }

    def take(self, after: int = 0, max_bytes: int = 64 << 20) -> dict[str, Any]:
        if not self.engine.capture.enabled:
            raise ControlError("capture is off (start the server with --capture)")
        if after < 0 or max_bytes < 1:
            raise ControlError("after: must be >= 0 and max_bytes >= 1")
        capture = self.engine.capture
        samples = capture.take(after, min(max_bytes, MAX_TAKE_BYTES))
        return {
            "data": encode_samples(samples),
            "count": len(samples),
            "last_seq": samples[-1].seq if samples else after,
            "newest_seq": capture.last_seq,
        }

    def target(self) -> dict[str, Any]:
        model = self.engine.model
        tensors = {
            "model.embed_tokens.weight": model.embed_tokens.weight,
            "model.norm.weight": model.norm.weight,
        }
        if not model.cfg.tie_word_embeddings:
            tensors["lm_head.weight"] = model.lm_head.weight
        hf = json.loads((self.engine.model_path / "config.json").read_text())
        meta = {"config": json.dumps(hf), "weight_version": self.engine.weight_version}
        data = save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata=meta)
        return {"data": data, "weight_version": self.engine.weight_version}
