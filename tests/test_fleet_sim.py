"""The fleet simulation's model: step counts by hand, and what speculation and more
replicas must do to makespan and idle time."""

from __future__ import annotations

import pytest

from benchmarks.fleet import Profile, loglog, replica_time, simulated_rollout


def flat(step_s: float = 1.0, accept: float = 1.0, cost: float = 1.0, spec_max: int = 2,
         max_seqs: int = 4) -> Profile:
    return Profile("t", lambda b: step_s, lambda b: accept, lambda b: cost, spec_max,
                   max_seqs, "test")


def test_plain_decoding_takes_one_step_per_token() -> None:
    p = flat()
    assert replica_time([5], p, speculate=False) == 5.0
    assert replica_time([5, 3, 2], p, speculate=False) == 5.0  # a batch moves together
    # 6 sequences, 4 rows: the two shortest wait for rows (queue sorted longest first)
    assert replica_time([4, 4, 4, 4, 1, 1], p, speculate=False) == 5.0


def test_tail_speculation_moves_one_plus_accept_tokens_per_step() -> None:
    p = flat(accept=1.0, cost=1.5, spec_max=1)
    assert replica_time([8], p, speculate=True) == pytest.approx(4 * 1.5)
    # batch 2 > spec_max: plain until one finishes, then the last runs speculating
    assert replica_time([2, 6], p, speculate=True) == pytest.approx(2 + 2 * 1.5)


def test_replicas_split_round_robin_and_idle_is_the_wait_for_the_last() -> None:
    p = flat()
    span, idle = simulated_rollout([10, 2, 4, 2], 2, p, speculate=False)
    assert span == 10 and idle == 8  # replica 0: 10 and 4; replica 1: 2 and 2
    assert simulated_rollout([10, 2], 1, p, speculate=False) == (10, 0)


def test_loglog_interpolates_between_and_is_flat_outside() -> None:
    f = loglog({1: 1.0, 4: 4.0})
    assert f(2) == pytest.approx(2.0) and f(0) == 1.0 and f(64) == 4.0


def test_a_measured_step_profile_feeds_the_simulation(tmp_path) -> None:
    """``profile steps`` (its CPU dry run: a tiny random model) writes the step and verify
    costs the simulation's device profile reads in place of the assumed H100 figures."""
    import json

    from benchmarks.fleet import device_profile
    from benchmarks.profile import main as profile

    out = tmp_path / "profile.json"
    profile(["steps", "--device", "cpu", "--shapes", "tiny", "--batches", "1,2", "--k", "2",
             "--context", "64", "--iters", "1", "--repeats", "1", "--train-rows", "1",
             "--train-row-len", "16", "--draft-vocab", "512", "--bandwidth-gbs", "20",
             "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["shapes"]["tiny"]["rows"]
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(r["eager_ms"] > 0 and "graph_ms" not in r for r in rows)  # no graphs on a CPU
    assert all(r["floor_ms"] > 0 for r in rows if r["k"] == 0)
    assert result["shapes"]["tiny"]["drafter"]["train_micro_step_ms"] > 0
    assert out.with_suffix(".png").is_file()
    p = device_profile(out, "tiny", 2, 3.0, 32, 256)
    plain = {r["batch"]: r["eager_ms"] / 1000 for r in rows if r["k"] == 0}
    verify = {r["batch"]: r["eager_ms"] / 1000 for r in rows if r["k"] == 2}
    assert p.step_s(2) == pytest.approx(plain[2])
    assert p.verify_cost(1) == pytest.approx(verify[1] / plain[1])
    assert p.accept(1) == 3.0 and "accept 3.0 drafts per verify assumed" in p.source
    with pytest.raises(SystemExit, match="no shape '8b'"):
        device_profile(out, "8b", 2, 3.0, 32, 256)
