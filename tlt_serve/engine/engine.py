"""The engine: one loop, ``step()`` = schedule → forward → sample → capture → postprocess.

Not thread-safe: exactly one thread calls its methods (the offline LLM, or the server's
engine loop, which applies control messages between steps).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from tlt_serve.capture import CaptureBuffer
from tlt_serve.config import EngineConfig
from tlt_serve.engine.detokenizer import Detokenizer
from tlt_serve.engine.features import committed_features
from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.engine.request import Request
from tlt_serve.engine.runner import ModelRunner
from tlt_serve.engine.sampler import Sampler
from tlt_serve.engine.scheduler import Emitted, Sampled, Scheduler
from tlt_serve.engine.stats import EngineStats
from tlt_serve.engine.weight_sync import TensorSpec, WeightSyncGroup
from tlt_serve.models.loader import (
    WeightError,
    build_model,
    checkpoint_names,
    load_weights,
    served_tensors,
)
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer
from tlt_serve.sampling_params import ParamError, SamplingParams
from tlt_serve.speculative.checkpoint import load_drafter
from tlt_serve.speculative.decoder import build_spec_decoder

log = logging.getLogger("tlt_serve.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class UpdateResult:
    ok: bool
    message: str
    weight_version: str


@dataclass(frozen=True)
class DrafterUpdate:
    ok: bool
    message: str
    drafter_version: int | None  # serving after the call


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        mc = config.model
        self.model_path: Path = resolve_model_path(mc.model)
        self.tokenizer = load_tokenizer(self.model_path)
        t0 = time.perf_counter()
        self.model = build_model(self.model_path, DTYPES[mc.dtype], mc.max_model_len, mc.device)
        log.info("loaded %s (%s) in %.1fs", self.model_path, mc.dtype, time.perf_counter() - t0)
        self.kv = KVCache(
            self.model.cfg, config.cache.max_num_seqs, mc.max_model_len, DTYPES[mc.dtype], mc.device
        )
        rows = config.cache.max_num_seqs
        self.spec = build_spec_decoder(
            config.spec, self.model, rows, mc.max_model_len, seed=config.seed
        )
        self.capture = CaptureBuffer(config.capture, seed=config.seed)
        self.drafter_path = config.spec.drafter if self.spec.drafter is not None else None
        self.runner = ModelRunner(self.model, self.kv, mc.device, self.spec.feature_layers)
        self.scheduler = Scheduler(
            num_rows=rows,
            max_len=mc.max_model_len,
            max_prefill_tokens=config.scheduler.max_prefill_tokens,
            eos_ids=self.tokenizer.eos_ids,
            move_row=self._move_row,
        )
        self.sampler = Sampler(config.seed)
        self.stats = EngineStats()
        self.weight_version = "0"
        self.weight_sync: WeightSyncGroup | None = None

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> list[str]:
        """Queue a request; with ``params.n > 1`` its n samples share one prefill.

        Returns the engine ids of the samples (``rid`` itself when n == 1, else ``rid#i``).
        Raises ParamError for a prompt the engine cannot run.
        """
        self._check_prompt(prompt_ids)
        if len(self.scheduler.waiting) + params.n > self.config.scheduler.max_waiting:
            # n samples take n queue places: count them all, or a big n overshoots the cap.
            raise OverflowError(f"queue full ({self.config.scheduler.max_waiting} waiting)")
        rids = sample_rids(rid, params.n)
        for i, sub in enumerate(rids):
            seed = None if params.seed is None else params.seed + i
            self.scheduler.add(
                Request(
                    rid=sub,
                    prompt_ids=list(prompt_ids),
                    params=params,
                    detok=Detokenizer(
                        self.tokenizer.hf, prompt_ids, params.skip_special_tokens, params.stop,
                        keep_stop=params.include_stop_in_text,
                        spaces_between_special_tokens=params.spaces_between_special_tokens,
                    ),
                    group=rid if params.n > 1 else None,
                    generator=None if seed is None else torch.Generator().manual_seed(seed),
                )
            )
        self.stats.on_add(len(rids), len(prompt_ids))
        return rids

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ParamError("input_ids", "prompt is empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ParamError(
                "input_ids", f"token id {bad} outside vocabulary [0, {self.vocab_size})"
            )
        limit = self.config.model.max_model_len - 1
        if len(prompt_ids) > limit:
            raise ParamError(
                "input_ids", f"prompt has {len(prompt_ids)} tokens, the limit is {limit}"
            )

    def abort(self, rid: str) -> list[StepOutput]:
        """Abort a request (all its samples); returns their final outputs (partial tokens)."""
        family = [r for r in self._requests() if r.rid == rid or r.group == rid]
        outs = [self.scheduler.abort(r.rid, self.weight_version) for r in family]
        self.spec.release(family)
        self.capture.release(family)
        return [o for o in outs if o is not None]

    def abort_all(self) -> list[StepOutput]:
        reqs = self._requests()
        outs = self.scheduler.abort_all(self.weight_version)
        self.spec.release(reqs)
        self.capture.release(reqs)
        return outs

    def _requests(self) -> list[Request]:
        return list(self.scheduler.waiting) + self.scheduler.running

    def _move_row(self, src: int, dst: int, length: int) -> None:
        self.kv.copy_row(src, dst, length)
        self.spec.move_row(src, dst, length)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one target forward for the scheduled batch and return each request's delta.

        A decode batch may speculate: the proposer drafts (chains or trees), one forward
        scores every request's last token plus its drafts, and verification commits the
        accepted drafts plus one token per request.
        """
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        t0 = time.perf_counter()
        plan = self.spec.plan(batch)
        emitted: Sampled | Emitted
        if plan is None:
            run = self.runner.run(batch)
            emitted = self.sampler.sample(run.logits[batch.logit_index], batch.samplers)
        else:
            run, emitted = self.spec.verify(
                plan, batch.forward, self.runner, self.sampler.generator
            )
        if self.spec.needs_features or self.capture.enabled:
            committed = committed_features(batch, run, emitted, self.spec.feature_layers)
            self.spec.observe(committed)
            self.capture.observe(committed, self.weight_version)
        outputs = self.scheduler.postprocess(batch, emitted, self.weight_version)
        if self.capture.enabled:
            done = [r for r in batch.samplers if r.finished]
            self.capture.finish(done, self.spec.drafter_version)
        seconds = time.perf_counter() - t0
        self.spec.end_step(batch, outputs, seconds)
        self.stats.on_step(batch, emitted, outputs, seconds)
        return outputs

    # ---- drafter ---------------------------------------------------------------------------
    def update_drafter(self, path: str, version: int | None = None) -> DrafterUpdate:
        """Load a drafter checkpoint and serve it from the next step (call between steps).

        It is validated completely (fits the target, same feature layers) before anything
        changes; on failure the serving drafter stays and the message says why. ``version``
        overrides the checkpoint's own.
        """
        try:
            new = load_drafter(path, self.model)
            if version is not None:
                new.spec = replace(new.spec, version=version)
            self.spec.swap_drafter(new)
        except ValueError as err:  # DrafterError included
            return DrafterUpdate(False, str(err), self.spec.drafter_version)
        self.drafter_path = path
        log.info("drafter %s → version %d", path, new.spec.version)
        return DrafterUpdate(True, f"serving drafter version {new.spec.version}", new.spec.version)

    # ---- weights ---------------------------------------------------------------------------
    def update_weights(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: str | None = None
    ) -> UpdateResult:
        """Copy HF-named tensors into the target in place, all or nothing.

        Call between steps. On success the version becomes ``version`` (or increments);
        on failure nothing changed and the message says which tensor was wrong.
        """
        try:
            n = load_weights(self.model, tensors)
        except WeightError as err:
            return UpdateResult(False, str(err), self.weight_version)
        if n == 0:
            return UpdateResult(False, "no weights in the update", self.weight_version)
        self.weight_version = version if version is not None else next_version(self.weight_version)
        self.spec.weights_changed()
        log.info("weights updated (%d tensors) → version %s", n, self.weight_version)
        return UpdateResult(True, f"updated {n} tensors", self.weight_version)

    def export_weights(self, path: str) -> int:
        """Write the served target weights to ``path`` (safetensors, HF names, served dtype):
        a replica joining a fleet loads them to serve exactly what its peers serve."""
        names = checkpoint_names(self.model_path)
        tensors = served_tensors(self.model, names)
        save_file(tensors, path, metadata={"weight_version": self.weight_version})
        return len(tensors)

    def set_weight_version(self, version: str) -> None:
        """Relabel the current weights (``/update_weight_version``); weights are untouched."""
        if not version:
            raise ParamError("new_version", "must be a non-empty string")
        self.weight_version = version

    def close_weight_sync(self) -> bool:
        """Leave the trainer's weight-broadcast group; False when there was none."""
        had, self.weight_sync = self.weight_sync is not None, None
        return had

    def init_weight_sync(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float = 120.0,
    ) -> UpdateResult:
        """Join the trainer's weight-broadcast group (blocks until all ranks have joined or
        ``timeout_s``). Touches nothing else: it may run on a worker thread while another
        thread steps, as long as nothing else uses ``weight_sync`` meanwhile."""
        try:
            self.weight_sync = WeightSyncGroup(
                master_address,
                master_port,
                rank,
                world_size,
                backend,
                timeout_s=timeout_s,
                device=self.config.model.device,
            )
        except (RuntimeError, ValueError) as err:  # rendezvous timeout, refused, bad args
            return UpdateResult(
                False, f"init_weights_update_group failed: {err}", self.weight_version
            )
        return UpdateResult(True, f"joined as rank {rank} of {world_size}", self.weight_version)

    def update_weights_from_distributed(
        self, specs: list[TensorSpec], version: str | None = None
    ) -> UpdateResult:
        """Receive the named tensors from the trainer (rank 0), then apply them all or none."""
        received = self.receive_weights(specs)
        if isinstance(received, UpdateResult):
            return received
        return self.update_weights(received, version)

    def receive_weights(
        self, specs: list[TensorSpec]
    ) -> list[tuple[str, torch.Tensor]] | UpdateResult:
        """The tensors rank 0 broadcasts (blocks until it has), or the failure. Touches no
        weight: it may run on a worker thread while another thread steps."""
        if self.weight_sync is None:
            return UpdateResult(
                False,
                "no weight update group: call init_weights_update_group first",
                self.weight_version,
            )
        try:
            return self.weight_sync.receive(specs)
        except (RuntimeError, ValueError) as err:
            return UpdateResult(False, f"receiving weights failed: {err}", self.weight_version)


def sample_rids(rid: str, n: int) -> list[str]:
    """Engine ids of a request's samples: ``rid`` itself when n == 1, else ``rid#0..``."""
    return [rid] if n == 1 else [f"{rid}#{i}" for i in range(n)]


def next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"
