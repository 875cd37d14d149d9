"""The example GRPO loop (clients/grpo.py) against a real fp32 server on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clients.grpo import GrpoConfig, GrpoLoop, advantages, policy_loss
from clients.tasks import Problem
from tests.harness import Served


def test_advantages_are_group_relative() -> None:
    a = advantages([1.0, 0.0, 0.0, 1.0])
    assert a[0] == pytest.approx(a[3]) and a[0] > 0 > a[1]
    assert sum(a) == pytest.approx(0.0, abs=1e-9)
    assert advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]  # no signal


def test_policy_loss_clips_the_ratio() -> None:
    old = torch.zeros(3)
    new = torch.tensor([0.0, 1.0, -1.0], requires_grad=True)  # ratios 1, e, 1/e
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, stats = policy_loss(new, old, adv, 0.2, 3)
    # min(r A, clip(r) A): 1, 1.2 (clipped), -max(1/e, 0.8) = -0.8
    assert float(loss.detach()) == pytest.approx(-(1.0 + 1.2 - 0.8) / 3)
    assert stats["clipped"] == 2.0
    loss.backward()
    assert new.grad is not None and new.grad[1] == 0.0 and new.grad[2] == 0.0  # clipped


def _length_reward(p: Problem, text: str) -> float:
    return float(len(text) % 2)  # varies within a group, so every step trains


def test_loop_trains_pushes_and_stays_on_policy(served: Served, tmp_path: Path) -> None:
    cfg = GrpoConfig(server=served.base_url, model=str(served.model_dir), out=str(tmp_path),
                     steps=3, prompts=2, group=4, max_new_tokens=8, lr=1e-3, micro_batch=3,
                     server_dtype="float32", pause_drafter=True)
    loop = GrpoLoop(cfg, reward_fn=_length_reward)
    before = {n: p.detach().clone() for n, p in loop.params.items()}
    paused_during_train: list[bool] = []
    train = loop.train

    def spy(rollouts):  # type: ignore[no-untyped-def]
        paused_during_train.append(loop.client.drafter_info()["training"]["paused"])
        return train(rollouts)

    loop.train = spy  # type: ignore[method-assign]
    records = loop.run()
    assert paused_during_train == [True, True, True]
    # Each step's rollouts ran on the weights pushed after the previous step.
    assert [r["weight_versions"] for r in records[1:]] == [["grpo-1"], ["grpo-2"]]
    for r in records:
        assert r["trained_sequences"] > 0
        # fp32 server: its logprobs are the policy's own, before this step's update, so the
        # ratio is 1 — the server serves exactly the weights pushed after the last step.
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert abs(r["kl_old_new"]) < 1e-4
    assert any(not torch.equal(before[n], p) for n, p in loop.params.items())
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert {"rollout_s", "train_s", "sync_s", "reward", "len_p90"} <= set(logged[0])
    with loop.client as c:
        assert c.weight_version() == "grpo-3"
        # Drafter training was paused around every update and resumed after it.
        assert c.drafter_info()["training"]["paused"] is False
