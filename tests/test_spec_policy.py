"""The strategy bandit: hard switch above max_batch, exploration first, then the best median."""

from __future__ import annotations

from tlt_serve.spec.policy import PLAIN, Strategy, StrategyBandit

NGRAM4 = Strategy("ngram", 4)
DRAFT4 = Strategy("drafter", 4)


def test_never_speculates_above_max_batch() -> None:
    bandit = StrategyBandit([PLAIN, NGRAM4, DRAFT4], max_batch=8)
    assert all(bandit.choose(bs) == PLAIN for bs in (9, 16, 64, 1000))
    bandit.update(16, NGRAM4, tokens=100, seconds=0.01)  # ignored: nothing is learned there
    assert bandit.table().get("9-16") is None


def test_fixed_strategy_has_one_arm_and_no_exploration() -> None:
    bandit = StrategyBandit([DRAFT4], max_batch=4)
    assert {bandit.choose(bs) for bs in (1, 2, 3, 4)} == {DRAFT4}
    assert bandit.choose(5) == PLAIN
    assert StrategyBandit([], max_batch=64).choose(1) == PLAIN


def test_tries_every_arm_then_exploits_the_best_median_per_bucket() -> None:
    arms = [PLAIN, NGRAM4, DRAFT4]
    bandit = StrategyBandit(arms, max_batch=64, epsilon=0.0, min_trials=3)
    speed = {
        1: {PLAIN: 30.0, NGRAM4: 45.0, DRAFT4: 80.0},
        32: {PLAIN: 900, NGRAM4: 700, DRAFT4: 600},
    }
    for bs, table in speed.items():
        tried = []
        for _ in range(3 * len(arms)):
            arm = bandit.choose(bs)
            tried.append(arm)
            bandit.update(bs, arm, tokens=int(table[arm]), seconds=1.0)
        assert sorted(tried) == sorted(arms * 3)  # each explored min_trials times first
    assert bandit.choose(1) == DRAFT4
    assert bandit.choose(32) == PLAIN  # large batches: learned that speculation loses
    # An outlier does not flip a median.
    bandit.update(1, NGRAM4, tokens=10_000, seconds=1.0)
    assert bandit.choose(1) == DRAFT4
    assert bandit.table()["1"] == {"none": 30.0, "ngram:4": 45.0, "drafter:4": 80.0}


def test_epsilon_explores_with_a_seeded_stream() -> None:
    def picks(seed: int) -> list[Strategy]:
        b = StrategyBandit([PLAIN, NGRAM4], max_batch=8, epsilon=0.5, min_trials=1, seed=seed)
        b.update(1, PLAIN, 10, 1.0)
        b.update(1, NGRAM4, 20, 1.0)
        return [b.choose(1) for _ in range(200)]

    a = picks(0)
    assert a == picks(0)  # reproducible
    assert 0.1 < a.count(PLAIN) / len(a) < 0.4  # ~ epsilon / 2 of the picks are the worse arm
