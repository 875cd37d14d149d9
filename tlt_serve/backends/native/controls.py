"""The native engine's answer to every control (``contract/controls.py``), between two steps.

``HANDLERS`` is the table the loop dispatches on: control type → handler. A handler returns
its control's reply, raises ``ControlError`` to refuse (nothing changed), or returns a
``Background``: the torch.distributed controls wait on the trainer (the rendezvous, the
broadcast), so their waiting runs on a worker thread while the engine keeps stepping, and
their result is applied by the loop between two steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save

from tlt_serve.backends.native.updates import EngineUpdates
from tlt_serve.contract.controls import (
    MAX_TAKE_BYTES,
    PAUSE_MODES,
    Continue,
    ControlError,
    ControlOp,
    DestroyWeightsUpdateGroup,
    Done,
    DrafterState,
    DrafterSwapped,
    ExportWeights,
    FlushCache,
    GetDrafterInfo,
    GetDrafterTarget,
    GetInfo,
    GetStats,
    InitWeightsUpdateGroup,
    Pause,
    Paused,
    Samples,
    TakeSamples,
    TargetFeed,
    UpdateDrafterFromDisk,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromFile,
    UpdateWeightVersion,
    WeightsExported,
    WeightsUpdated,
)
from tlt_serve.contract.reports import EngineInfo, SpecInfo, StatsSnapshot, snapshot_of
from tlt_serve.engine.capture import TrainingSample, encode_samples, encode_shared
from tlt_serve.engine.engine import Engine
from tlt_serve.engine.handoff import Lent
from tlt_serve.models.loader import iter_safetensors
from tlt_serve.weight_sync import TensorSpec

log = logging.getLogger("tlt_serve.native")


@dataclass(frozen=True)
class Background:
    """A control's slow part: ``work`` runs on a worker thread (it may touch only what the
    loop leaves alone meanwhile); ``finish`` gets its result on the loop, between two steps,
    and returns the reply. An exception from either fails the control."""

    work: Callable[[], Any]
    finish: Callable[[Any], Any]


class NativeControls:
    def __init__(self, engine: Engine, abort_all: Callable[[], None]) -> None:
        self.engine = engine
        self.updates = EngineUpdates(engine)
        self.abort_all = abort_all  # aborts every request; the loop sends their final outputs
        self.paused = False
        self.group_name: str | None = None  # the weight-sync group joined, if any
        self.lent = Lent()  # captured features lent to a trainer on this machine

    # ---- reports ---------------------------------------------------------------------------
    def info(self, op: GetInfo) -> EngineInfo:
        engine, spec = self.engine, self.updates.spec
        cfg = engine.config
        return EngineInfo(
            model=cfg.model.model,
            model_path=str(engine.model_path),
            dtype=cfg.model.dtype,
            vocab_size=engine.vocab_size,
            max_model_len=cfg.model.max_model_len,
            max_num_seqs=cfg.cache.max_num_seqs,
            max_waiting=cfg.scheduler.max_waiting,
            eos_ids=tuple(sorted(engine.tokenizer.eos_ids)),
            weight_version=engine.weight_version,
            max_logprobs=cfg.model.max_logprobs,
            compiled=engine.runner.graphs is not None,
            spec=SpecInfo(
                method=spec.config.method,
                proposer=spec.proposer_name,
                num_draft_tokens=spec.config.num_draft_tokens,
                max_batch=spec.config.max_batch,
                drafter=spec.config.drafter,
                strategies=tuple(str(a) for a in spec.policy.arms),
            ),
        )

    def stats(self, op: GetStats) -> StatsSnapshot:
        engine, sched = self.engine, self.engine.scheduler
        prefix = engine.prefix.stats() if engine.prefix is not None else None
        return snapshot_of(
            engine.stats,
            running=len(sched.running),
            waiting=len(sched.waiting),
            max_num_seqs=engine.config.cache.max_num_seqs,
            weight_version=engine.weight_version,
            paused=self.paused,
            drafter_version=engine.spec.drafter_version,
            capture=engine.capture.stats(),
            spec_policy=self.updates.spec.policy.table(),
            kv_tokens=sum(r.num_tokens for r in sched.running),
            prefix_hit_tokens=prefix.hit_tokens if prefix else 0,
            prefix_entries=prefix.entries if prefix else 0,
        )

    # ---- serving ---------------------------------------------------------------------------
    def pause(self, op: Pause) -> Paused:
        if op.mode not in PAUSE_MODES:
            raise ControlError(f"mode: must be one of {PAUSE_MODES}, got {op.mode!r}", "mode")
        if op.mode == "abort":
            self.abort_all()
        if op.mode == "drain":
            self.engine.scheduler.admitting = False
            self.settle()
        else:
            self.paused = True
        return Paused(op.mode)

    def settle(self) -> None:
        """A drain is over once nothing runs: the engine is paused from then on."""
        sched = self.engine.scheduler
        if not sched.admitting and not sched.running:
            self.paused = True

    def resume(self, op: Continue) -> Done:
        self.paused = False
        self.engine.scheduler.admitting = True
        return Done()

    def flush_cache(self, op: FlushCache) -> Done:
        """Refused while a request runs (it holds KV); waiting ones hold none (while paused,
        new requests wait: slime flushes then, before a weight update)."""
        running = len(self.engine.scheduler.running)
        if running:
            raise ControlError(f"cache not flushed: {running} requests are running")
        if self.engine.prefix is not None:
            self.engine.prefix.clear()
        return Done()

    # ---- target weights --------------------------------------------------------------------
    def from_disk(self, op: UpdateWeightsFromDisk) -> WeightsUpdated:
        if op.abort_all:
            self.abort_all()
        try:
            return self.updates.load(iter_safetensors(op.model_path), op.weight_version)
        except (OSError, SafetensorError) as err:
            raise ControlError(f"model_path: cannot read {op.model_path!r}: {err}",
                               "model_path") from err

    def from_file(self, op: UpdateWeightsFromFile) -> WeightsUpdated:
        try:  # every tensor is read before the model is touched: a truncated upload fails here
            tensors = load_file(op.path)
        except (OSError, SafetensorError) as err:
            raise ControlError(f"body: not a valid safetensors payload: {err}", "body") from err
        return self.updates.load(tensors.items(), op.weight_version)

    def set_version(self, op: UpdateWeightVersion) -> WeightsUpdated:
        if op.abort_all:
            self.abort_all()
        return self.updates.relabel(op.new_version)

    def export(self, op: ExportWeights) -> WeightsExported:
        return self.updates.export(op.path)

    def init_group(self, op: InitWeightsUpdateGroup) -> Background:
        def joined(result: WeightsUpdated) -> WeightsUpdated:
            self.group_name = op.group_name
            return result

        return Background(lambda: self.updates.join_group(
            op.master_address, op.master_port, op.rank_offset, op.world_size, op.backend,
            op.timeout_s), joined)

    def from_group(self, op: UpdateWeightsFromDistributed) -> Background:
        if self.group_name is not None and op.group_name != self.group_name:
            raise ControlError(f"group_name: the group is {self.group_name!r}, not "
                               f"{op.group_name!r}", "group_name")
        if op.abort_all:
            self.abort_all()
        specs = [TensorSpec(n, d, tuple(s))
                 for n, d, s in zip(op.names, op.dtypes, op.shapes, strict=True)]
        # Waiting for rank 0's broadcasts on a worker thread; applying, on the loop.
        return Background(lambda: self.updates.receive(specs),
                          lambda received: self.updates.load(received, op.weight_version))

    def destroy_group(self, op: DestroyWeightsUpdateGroup) -> WeightsUpdated:
        if self.group_name is None or op.group_name != self.group_name:
            raise ControlError(f"group_name: no group {op.group_name!r}", "group_name")
        self.updates.leave_group()
        self.group_name = None
        return WeightsUpdated(f"left {op.group_name}", self.engine.weight_version)

    # ---- the drafter and its trainer -------------------------------------------------------
    def swap_drafter(self, op: UpdateDrafterFromDisk) -> DrafterSwapped:
        return self.updates.swap_drafter(op.path, op.version)

    def drafter_info(self, op: GetDrafterInfo) -> DrafterState:
        engine, spec = self.engine, self.updates.spec
        drafter = spec.drafter
        return DrafterState(
            drafter_version=spec.drafter_version,
            drafter_path=self.updates.drafter_path,
            feature_layers=list(spec.feature_layers),
            draft_vocab_size=None if drafter is None else drafter.spec.draft_vocab_size,
            sliced_head=True,  # a checkpoint's draft_vocab restricts the drafts
            target_weight_version=None if drafter is None
            else drafter.spec.target_weight_version,
            weight_version=engine.weight_version,
            recent_accept_length=round(engine.stats.recent_accept_length, 4),
            recent_verify_steps=len(engine.stats.recent_spec),
            capture=dataclasses.asdict(engine.capture.stats()),
        )

    def take_samples(self, op: TakeSamples) -> Samples:
        capture = self.engine.capture
        if not capture.enabled:
            raise ControlError("capture is off (start the server with --capture)")
        if op.after < 0 or op.max_bytes < 1:
            raise ControlError("after: must be >= 0 and max_bytes >= 1", "after")
        samples = capture.take(op.after, min(op.max_bytes, MAX_TAKE_BYTES))
        return Samples(self._encode(samples, op.share), len(samples),
                       samples[-1].seq if samples else op.after, capture.last_seq)

    def _encode(self, samples: list[TrainingSample], share: bool) -> bytes:
        """By reference when asked and the features stay where the model runs; by value
        where the memory cannot be shared (a full /dev/shm, CUDA's expandable segments)."""
        if share and self.engine.config.capture.on_device:
            try:
                return encode_shared(samples, self.lent)
            except (RuntimeError, ValueError) as err:
                log.warning("captured features go by value: sharing them failed: %s", err)
        return encode_samples(samples)

    def drafter_target(self, op: GetDrafterTarget) -> TargetFeed:
        engine, model = self.engine, self.engine.model
        tensors = {
            "model.embed_tokens.weight": model.embed_tokens.weight,
            "model.norm.weight": model.norm.weight,
        }
        if not model.cfg.tie_word_embeddings:
            tensors["lm_head.weight"] = model.lm_head.weight
        hf = json.loads((engine.model_path / "config.json").read_text())
        meta = {"config": json.dumps(hf), "weight_version": engine.weight_version}
        data = save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata=meta)
        return TargetFeed(data, engine.weight_version)


HANDLERS: dict[type[ControlOp[Any]], Callable[[NativeControls, Any], Any]] = {
    GetInfo: NativeControls.info,
    GetStats: NativeControls.stats,
    Pause: NativeControls.pause,
    Continue: NativeControls.resume,
    FlushCache: NativeControls.flush_cache,
    UpdateWeightsFromDisk: NativeControls.from_disk,
    UpdateWeightsFromFile: NativeControls.from_file,
    UpdateWeightVersion: NativeControls.set_version,
    InitWeightsUpdateGroup: NativeControls.init_group,
    UpdateWeightsFromDistributed: NativeControls.from_group,
    DestroyWeightsUpdateGroup: NativeControls.destroy_group,
    ExportWeights: NativeControls.export,
    UpdateDrafterFromDisk: NativeControls.swap_drafter,
    GetDrafterInfo: NativeControls.drafter_info,
    TakeSamples: NativeControls.take_samples,
    GetDrafterTarget: NativeControls.drafter_target,
}
# Refused while a background control (which holds the weight-sync group) is in flight.
BACKGROUND_EXCLUSIVE = (InitWeightsUpdateGroup, UpdateWeightsFromDistributed,
                        DestroyWeightsUpdateGroup)
