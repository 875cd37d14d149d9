"""An example RL loop on a tlt-serve rollout server: GRPO on the arithmetic task.

Every step: (1) rollout — ``prompts`` problems x ``group`` samples through the server's
/generate, with the target's logprobs (the behaviour policy); (2) reward — the checked final
answer; advantages relative to the group (mean / std); (3) train — one clipped
policy-gradient step (PPO-style ratio against the server-reported logprobs, token mean) on an
fp32 copy of the policy; (4) sync — the changed tensors are written (in the server's dtype)
and pushed with ``/update_weights_from_disk`` (or uploaded, ``--push tensor``) as the next
weight version. Each step logs reward, response lengths, rollout / train / sync seconds,
accept length and drafter versions (JSON lines).

    tlt-serve serve --speculative auto --drafter D --train-drafter &
    python -m clients.grpo --server http://127.0.0.1:30000 --steps 8 --out runs/grpo
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from clients.client import Client
from clients.policy import load_policy, make_batch, response_logprobs
from clients.results import Sample
from clients.tasks import Problem, make_problems, prompt_ids, reward
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer


@dataclass(frozen=True)
class GrpoConfig:
    server: str = "http://127.0.0.1:30000"
    model: str = "smollm2-135m"  # the policy's starting weights: the server's model
    out: str = "runs/grpo"
    steps: int = 8
    prompts: int = 8  # problems per step
    group: int = 8  # samples per problem
    max_new_tokens: int = 256
    temperature: float = 1.0
    lr: float = 2e-6
    clip: float = 0.2
    micro_batch: int = 8  # sequences per forward / backward
    mean_ops: float = 3.0  # problem length (operations), geometric: long-tailed answers
    push: str = "disk"  # disk | tensor
    server_dtype: str = "bfloat16"
    pause_drafter: bool = False  # pause the server's drafter trainer while the policy trains
    seed: int = 0
    api_key: str | None = None

    def validate(self) -> None:
        for name in ("steps", "prompts", "micro_batch", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.group < 2:
            raise ValueError("group: must be >= 2 (advantages are relative to the group)")
        if self.push not in ("disk", "tensor"):
            raise ValueError(f"push: must be disk or tensor, got {self.push!r}")
        if self.server_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"server_dtype: bfloat16 or float32, not {self.server_dtype!r}")


@dataclass(frozen=True)
class Rollout:
    problem: Problem
    prompt: list[int]
    sample: Sample
    reward: float
    advantage: float


def advantages(rewards: Sequence[float]) -> list[float]:
    """Group-relative: (r - mean) / (std + eps); all-equal groups carry no signal (zeros)."""
    t = torch.tensor(rewards, dtype=torch.float64)
    std = float(t.std(unbiased=False))
    if std < 1e-6:
        return [0.0] * len(rewards)
    return [float(x) for x in (t - t.mean()) / (std + 1e-4)]


def policy_loss(
    new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, clip: float, total_tokens: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate, summed over tokens and divided by all tokens of the step.

    new, old, adv: [N] per response token (old: the server's logprobs)."""
    ratio = torch.exp(new - old)  # [N]
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)  # [N]
    loss = -surr.sum() / total_tokens
    with torch.no_grad():
        stats = {"ratio_sum": float(ratio.sum()),
                 "clipped": float(((ratio - 1).abs() > clip).float().sum()),
                 "kl_sum": float((old - new).sum())}
    return loss, stats


RewardFn = Callable[[Problem, str], float]


def policy_update(
    policy: Any, opt: torch.optim.Optimizer, rollouts: Sequence[Rollout], micro_batch: int,
    clip: float,
) -> dict[str, float]:
    """One clipped policy-gradient optimizer step over the rollouts with a non-zero
    advantage (micro-batches of ``micro_batch`` sequences, gradients accumulated)."""
    rows = [r for r in rollouts if r.advantage != 0.0 and r.sample.num_tokens > 0]
    total = sum(r.sample.num_tokens for r in rows)
    stats = {"ratio_sum": 0.0, "clipped": 0.0, "kl_sum": 0.0}
    if not rows:
        return {"trained_sequences": 0}
    params = [p for p in policy.parameters() if p.requires_grad]
    opt.zero_grad(set_to_none=True)
    for i in range(0, len(rows), micro_batch):
        part = rows[i : i + micro_batch]
        batch = make_batch([r.prompt for r in part], [r.sample.token_ids for r in part],
                           pad_id=0)
        new = response_logprobs(policy, batch)  # [N]
        old = torch.tensor([lp for r in part for lp in r.sample.logprobs or ()])
        adv = torch.tensor([r.advantage for r in part for _ in range(r.sample.num_tokens)])
        loss, s = policy_loss(new, old, adv, clip, total)
        loss.backward()  # type: ignore[no-untyped-call]
        for k in stats:
            stats[k] += s[k]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return {"trained_sequences": len(rows), "trained_tokens": total,
            "ratio_mean": stats["ratio_sum"] / total, "clip_frac": stats["clipped"] / total,
            "kl_old_new": stats["kl_sum"] / total, "grad_norm": float(grad_norm)}


class GrpoLoop:
    def __init__(self, cfg: GrpoConfig, reward_fn: RewardFn = reward) -> None:
        cfg.validate()
        self.cfg = cfg
        self.reward_fn = reward_fn
        self.model_dir = resolve_model_path(cfg.model)
        self.tok = load_tokenizer(self.model_dir)
        self.policy = load_policy(self.model_dir)
        self.params = {n: p for n, p in self.policy.named_parameters() if p.requires_grad}
        self.opt = torch.optim.AdamW(self.params.values(), lr=cfg.lr, weight_decay=0.0)
        self.client = Client(cfg.server, cfg.api_key)
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "log.jsonl"
        self.rng = random.Random(cfg.seed)

    def rollout(self, step: int) -> list[Rollout]:
        problems = make_problems(self.cfg.prompts, 7919 * self.cfg.seed + step,
                                 self.cfg.mean_ops)
        prompts = prompt_ids(self.tok, problems)
        groups = self.client.generate(
            prompts, n=self.cfg.group, return_logprob=True, temperature=self.cfg.temperature,
            max_new_tokens=self.cfg.max_new_tokens,
            sampling_seed=self.rng.randrange(1 << 31),
        )
        out = []
        for p, ids, group in zip(problems, prompts, groups, strict=True):
            rewards = [self.reward_fn(p, s.text) for s in group]
            for s, r, a in zip(group, rewards, advantages(rewards), strict=True):
                out.append(Rollout(p, ids, s, r, a))
        return out

    def train(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """One optimizer step over the rollouts that carry signal."""
        return policy_update(self.policy, self.opt, rollouts, self.cfg.micro_batch,
                             self.cfg.clip)

    def push(self, version: str) -> None:
        """Send the trained tensors (HF names, the server's dtype) as ``version``."""
        dtype = torch.bfloat16 if self.cfg.server_dtype == "bfloat16" else torch.float32
        tensors = {n: p.detach().to(dtype).contiguous() for n, p in self.params.items()}
        if self.cfg.push == "tensor":
            self.client.update_weights_from_tensors(tensors, weight_version=version)
            return
        path = self.out / "push.safetensors"
        save_file(tensors, str(path))
        self.client.update_weights_from_disk(str(path), weight_version=version)

    def run(self) -> list[dict[str, Any]]:
        records = []
        bar = tqdm(range(self.cfg.steps), desc="grpo", unit="step")
        for step in bar:
            t0 = time.perf_counter()
            rollouts = self.rollout(step)
            t1 = time.perf_counter()
            if self.cfg.pause_drafter:
                self.client.pause_drafter_training()
            try:
                train = self.train(rollouts)
                t2 = time.perf_counter()
                self.push(f"grpo-{step + 1}")
                t3 = time.perf_counter()
            finally:
                if self.cfg.pause_drafter:
                    self.client.resume_drafter_training()
            rec = {"step": step, "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
                   **summarize(rollouts), **train}
            records.append(rec)
            with self.log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            bar.set_postfix(reward=f"{rec['reward']:.2f}", rollout=f"{rec['rollout_s']:.0f}s",
                            accept=rec.get("accept_length"))
        return records


def summarize(rollouts: Sequence[Rollout]) -> dict[str, Any]:
    lengths = sorted(r.sample.num_tokens for r in rollouts)
    n = len(lengths)
    out: dict[str, Any] = {
        "reward": sum(r.reward for r in rollouts) / n,
        "len_mean": sum(lengths) / n,
        "len_p50": lengths[n // 2],
        "len_p90": lengths[min(n - 1, int(0.9 * n))],
        "len_max": lengths[-1],
        "lengths": lengths,
        "weight_versions": sorted({r.sample.weight_version for r in rollouts}),
    }
    specs = [r.sample.spec for r in rollouts if r.sample.spec is not None]
    verify = sum(s.verify_ct for s in specs)
    if verify:
        out["accept_length"] = round(sum(s.accept_length * s.verify_ct for s in specs) / verify,
                                     3)
        out["drafter_versions"] = sorted({v for s in specs for v in s.drafter_versions})
    return out


def main(argv: list[str] | None = None) -> None:
    d = GrpoConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            ap.add_argument(flag, type=type(value) if value is not None else str, default=value)
    cfg = GrpoConfig(**vars(ap.parse_args(argv)))
    try:
        cfg.validate()
    except ValueError as err:
        ap.error(str(err))
    records = GrpoLoop(cfg).run()
    last = records[-1]
    print(json.dumps({k: v for k, v in last.items() if k != "lengths"}))


if __name__ == "__main__":
    main()
