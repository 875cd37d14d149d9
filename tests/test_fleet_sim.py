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
