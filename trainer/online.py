"""``tlt-train online --server URL``: keep the server's drafter up to date, in idle gaps.

One ``tick`` is one short unit of work (a training micro-step of ``rows x row_len`` pairs,
one page of samples, one held-out piece of an evaluation), so the trainer notices returning
load within one micro-step. Each tick first asks the server's gate; while it is closed (more
requests in flight than the server allows, or training paused) the trainer only waits.

    gate → (target changed: refresh the borrowed embedding / head)
         → (pull new captured samples)
         → (evaluating: score one held-out piece of candidate and served drafter)
         → micro-step (EAGLE loss, gradient accumulation over ``accum`` micro-steps)
         → every ``eval_every`` steps: promotion guard; every ``checkpoint_every``: checkpoint

Promotion guard: the candidate (a snapshot of the training drafter) and the drafter the server
serves are scored on the same held-out recent samples (offline accept length, newest target
version); only a candidate better by ``min_gain`` is published (``published/v<N>``, then
``/update_drafter_from_disk``). The served drafter never gets worse by the guard's measure.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tlt_serve.devices import is_device
from tlt_serve.speculative.checkpoint import load_drafter, save_drafter
from tlt_serve.speculative.drafter import DrafterModel, DrafterSpec, new_drafter
from trainer.data import build_draft_vocab
from trainer.fleet_link import FleetLink
from trainer.link import LinkError, ServerLink, TargetTensors
from trainer.promote import Evaluation
from trainer.state import load_latest, save_checkpoint
from trainer.store import SampleStore, StoreConfig
from trainer.target import head_stub, update_stub
from trainer.train import TrainConfig, feature_noise, feature_std, make_optimizer, step_loss

log = logging.getLogger("trainer.online")


@dataclass(frozen=True)
class OnlineConfig:
    server: str = "http://127.0.0.1:30000"
    state_dir: str = ""
    init: str | None = None  # drafter checkpoint to start from (the server's --drafter)
    api_key: str | None = None
    seed: int = 0
    rows: int = 1  # packed rows per micro-step
    row_len: int = 64  # pairs per row: a tick takes ~130 ms here (benchmarks.adaptation yield)
    accum: int = 4  # micro-steps per optimizer step
    lr: float = 1e-3
    warmup_steps: int = 10
    min_train_tokens: int = 2048  # stored training tokens before the first step
    draft_vocab_size: int = 8192  # for a fresh drafter (a given one keeps its own)
    pull_every_s: float = 2.0
    pull_max_bytes: int = 16 << 20
    # Optimizer steps between promotion checks. A candidate is published only at a check, and
    # training runs in gaps (an RL policy update: 160-190 steps in the adaptation benchmark's
    # 100 s gaps): at 50, what a gap learnt often waited for the next gap. 20 vs 50, replaying
    # that benchmark's phases with 60-step gaps: accept at the second phase after each update,
    # over the reference's, mean 0.68 → 0.72, for ~3.5 s a check (4.9 vs 4.0 min, 480 steps).
    eval_every: int = 20
    eval_rows: int = 16  # held-out rows scored per check (row_len pairs each)
    eval_depth: int = 4
    min_gain: float = 0.01  # accept length a candidate must gain to be published
    checkpoint_every: int = 50
    poll_s: float = 0.1  # wait between gate checks while closed
    report_every_s: float = 2.0
    loss: TrainConfig = field(default_factory=lambda: TrainConfig(unroll=2))
    store: StoreConfig = field(default_factory=StoreConfig)
    device: str = "cpu"  # where the drafter trains (cuda: beside the engine on its GPU)
    memory_bytes: int = 0  # on a GPU: the most the trainer may allocate there (0: no cap)

    def validate(self) -> None:
        if not self.state_dir:
            raise ValueError("state_dir: a directory for checkpoints is required")
        if not is_device(self.device):
            raise ValueError(f"device: {self.device!r} is not cpu, cuda or cuda:N")
        if self.memory_bytes < 0:
            raise ValueError(f"memory_bytes: must be >= 0, got {self.memory_bytes}")
        for name in ("rows", "row_len", "accum", "eval_every", "eval_rows", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        self.store.validate()


class OnlineTrainer:
    def __init__(self, cfg: OnlineConfig, link: ServerLink | FleetLink) -> None:
        cfg.validate()
        self.cfg = cfg
        self.link = link
        self.state_dir = Path(cfg.state_dir)
        self.store = SampleStore(cfg.store)
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.micro = 0
        self.published_version = 0
        self.target_version = ""
        self.last_pull = float("-inf")
        self.last_report = float("-inf")
        self.state = "starting"
        self.losses: deque[float] = deque(maxlen=50)  # recent micro-step losses
        self.verdict: dict[str, Any] | None = None
        self.evaluation: Evaluation | None = None
        self.noise_std: float | None = None
        self.stop = threading.Event()
        self._resume_opt: dict[str, Any] | None = None
        self.resumed_from: tuple[str, int] | None = None  # (checkpoint, its step)
        self.fresh = False  # a new drafter, not a given or resumed one: it may be sliced
        self.device = torch.device(cfg.device)
        target = link.target()
        tensors = {k: v.to(self.device) for k, v in target.tensors.items()}
        self.stub = head_stub(target.cfg, tensors, max_positions=1 << 14)
        self.target_version = target.weight_version
        self.hf_config = target.hf_config
        self.drafter = self._initial_drafter(link.drafter_info())
        self.served = self._served_drafter()  # what the server serves: the guard's baseline
        self.opt = self._optimizer()

    # ---- set-up ------------------------------------------------------------------------
    def _initial_drafter(self, info: dict[str, Any]) -> DrafterModel:
        layers = tuple(int(i) for i in info.get("feature_layers") or ())
        if layers:
            raise ValueError(
                f"feature_layers: the server's drafter fuses target layers {list(layers)}; "
                "online training needs the target's final hidden states beside them, which "
                "capture does not keep: serve an EAGLE-1 drafter (tlt-train warmup without "
                "--feature-layers) to adapt it online"
            )
        resumed = load_latest(self.state_dir)
        if resumed is not None:
            path, payload = resumed
            spec = DrafterSpec(**{**payload["spec"], "feature_layers": layers})
            drafter = new_drafter(self.stub, spec, self.cfg.seed)
            drafter.load_state_dict(payload["drafter"])
            self.step = int(payload["step"])
            self.link.restore_cursor(payload["cursor"])
            self.published_version = int(payload["published_version"])
            self._resume_opt = payload["optimizer"]
            self.resumed_from = (str(path), self.step)
            log.info("resumed from %s (step %d, cursor %s)", path, self.step, payload["cursor"])
        elif self.cfg.init:
            drafter = load_drafter(self.cfg.init, self.stub)
            self.published_version = max(drafter.spec.version, info.get("drafter_version") or 0)
            log.info("starting from %s", self.cfg.init)
        else:
            spec = DrafterSpec(feature_layers=layers, draft_vocab_size=0)
            drafter = new_drafter(self.stub, spec, self.cfg.seed)
            self.published_version = int(info.get("drafter_version") or 0)
            # A sliced draft head only where the server drafts with one (vLLM drafts over
            # the whole vocabulary whatever the checkpoint holds).
            self.fresh = bool(info.get("sliced_head", True))
        drafter.refresh_head()
        return drafter.float().requires_grad_(True).train()

    def _served_drafter(self) -> DrafterModel:
        """The last published checkpoint (after a restart), else the starting weights."""
        path = self.state_dir / "published" / f"v{self.published_version}"
        if path.is_dir():
            served = load_drafter(path, self.stub).float()
        else:
            served = copy.deepcopy(self.drafter)
        return served.eval().requires_grad_(False)

    def _optimizer(self) -> torch.optim.Optimizer:
        opt = make_optimizer(self.drafter, self.cfg.loss, self.cfg.lr)
        if self._resume_opt is not None:
            opt.load_state_dict(self._resume_opt)
            self._resume_opt = None
        return opt

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        """Tick until ``stop`` is set; a lost server is retried with backoff."""
        backoff = 0.5
        while not self.stop.is_set():
            try:
                what = self.tick()
                if time.monotonic() - self.last_report >= self.cfg.report_every_s:
                    self.report()
                backoff = 0.5
            except LinkError as err:
                log.warning("server unreachable (%s); retrying in %.1fs", err, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            if what in ("waiting", "starving"):
                self.stop.wait(self.cfg.poll_s)

    def tick(self) -> str:
        """One short unit of work; returns what it did."""
        gate = self.link.gate()
        if not gate.train:
            self.state = "waiting"
            return "waiting"
        if gate.weight_version != self.target_version:
            self._refresh_target(self.link.target())
            return "refreshed"
        if time.monotonic() - self.last_pull >= self.cfg.pull_every_s:
            self.last_pull = time.monotonic()
            if self._pull():
                return "pulled"
        if self.evaluation is not None:
            self.state = "evaluating"
            return self._evaluate_piece()
        if self.store.train_tokens < self.cfg.min_train_tokens:
            self.state = "starving"
            return "starving"
        self.state = "training"
        if self._micro_step():
            if self.step % self.cfg.eval_every == 0:
                self._begin_evaluation()
            if self.step % self.cfg.checkpoint_every == 0:
                self.checkpoint()
        return "trained"

    # ---- data --------------------------------------------------------------------------
    @property
    def cursor(self) -> int:
        """Captured samples pulled so far (the server's sequence number; a fleet's sum)."""
        return self.link.pulled

    def _pull(self) -> int:
        return self.store.add(self.link.pull(self.cfg.pull_max_bytes))

    def _refresh_target(self, target: TargetTensors) -> None:
        update_stub(self.stub, target.tensors)
        self.drafter.refresh_head()
        self.served.refresh_head()
        self.target_version = target.weight_version
        self.evaluation = None  # its held-out argmax came from the old head
        log.info("target weights now version %s", target.weight_version)

    # ---- training ----------------------------------------------------------------------
    def _micro_step(self) -> bool:
        """One micro-batch forward + backward; True when it completed an optimizer step."""
        if self.fresh and self.cfg.draft_vocab_size and not self.step:
            self.fresh = False
            self._slice_vocab()
        batch = self.store.draw_batch(self.cfg.rows, self.cfg.row_len, self.rng)
        if batch is None:
            return False
        if self.noise_std is None:
            self.noise_std = feature_std([s.sample for s in self.store.train])
        lc = self.cfg.loss
        noise = feature_noise(batch.features.shape, lc, self.noise_std, self.gen)
        batch, noise = batch.to(self.device), noise.to(self.device)  # [rows, row_len, F]
        loss, _, _ = step_loss(self.drafter, batch, lc, noise)
        if loss.requires_grad:
            (loss / self.cfg.accum).backward()  # type: ignore[no-untyped-call]
        self.micro += 1
        self.losses.append(float(loss.detach()))
        if self.micro < self.cfg.accum:
            return False
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * min(1.0, (self.step + 1) / max(self.cfg.warmup_steps, 1))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.micro = 0
        self.step += 1
        return True

    def _slice_vocab(self) -> None:
        """A fresh drafter gets a draft vocabulary from the first samples' responses."""
        samples = [s.sample for s in self.store.train]
        responses = [s.tokens[s.prompt_len :].tolist() for s in samples]
        prompts = [s.tokens[: s.prompt_len].tolist() for s in samples]
        size = min(self.cfg.draft_vocab_size, self.stub.cfg.vocab_size)
        vocab = build_draft_vocab(responses, prompts, size, self.stub.cfg.vocab_size)
        spec = replace(self.drafter.spec, draft_vocab_size=size)
        state = {k: v for k, v in self.drafter.state_dict().items() if k != "draft_vocab"}
        drafter = new_drafter(self.stub, spec, self.cfg.seed)
        drafter.load_state_dict({**state, "draft_vocab": vocab})
        drafter.refresh_head()
        self.drafter = drafter.float().requires_grad_(True).train()
        self.served = copy.deepcopy(self.drafter).eval().requires_grad_(False)
        self.opt = self._optimizer()

    # ---- promotion guard ---------------------------------------------------------------
    def _begin_evaluation(self) -> None:
        held = self.store.heldout_samples()
        if held:
            candidate = copy.deepcopy(self.drafter).eval().requires_grad_(False)
            cfg = self.cfg
            self.evaluation = Evaluation(candidate, self.served, held, self.step, cfg.row_len,
                                         cfg.eval_rows, cfg.eval_depth, cfg.min_gain)

    def _evaluate_piece(self) -> str:
        ev = self.evaluation
        assert ev is not None
        verdict = ev.advance()
        if verdict is None:
            return "evaluated"
        self.evaluation = None
        self.verdict = verdict.as_dict()
        log.info("promotion guard: %s", self.verdict)
        if verdict.promote:
            self.publish(ev.candidate)
            return "published"
        return "kept"

    def publish(self, candidate: DrafterModel) -> None:
        version = self.published_version + 1
        spec = replace(
            candidate.spec, version=version, target_weight_version=self.target_version
        )
        candidate.spec = spec
        path = save_drafter(
            candidate, self.state_dir / "published" / f"v{version}", self.hf_config, spec
        )
        self.link.publish(str(path), version)
        self.published_version = version
        self.served = candidate
        self.checkpoint()
        log.info("published drafter version %d", version)

    # ---- persistence and reports -------------------------------------------------------
    def checkpoint(self) -> Path:
        return save_checkpoint(
            self.state_dir,
            {
                "drafter": self.drafter.state_dict(),
                "spec": dataclasses.asdict(self.drafter.spec),
                "optimizer": self.opt.state_dict(),
                "step": self.step,
                "cursor": self.link.cursor,
                "published_version": self.published_version,
            },
        )

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "pid": os.getpid(),
            "step": self.step,
            "published_version": self.published_version,
            "cursor": self.cursor,
            "loss": round(sum(self.losses) / len(self.losses), 4) if self.losses else None,
            "last_candidate": self.verdict,
            "resumed_from": None if self.resumed_from is None else self.resumed_from[0],
            "resumed_step": None if self.resumed_from is None else self.resumed_from[1],
            "device": str(self.device),
            "memory_budget_bytes": self.cfg.memory_bytes or None,
            "memory_peak_bytes": (torch.cuda.max_memory_allocated(self.device)
                                  if self.device.type == "cuda" else None),
        }

    def report(self) -> None:
        """Tell the server how training goes (shown by its /get_drafter_info)."""
        self.last_report = time.monotonic()
        self.link.report(self.status())
