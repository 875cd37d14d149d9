"""Which speculation strategy a decode step uses: an online bandit per batch-size bucket.

A strategy is (proposer, depth), for trees also top-k and budget, for suffix chains also the
estimated acceptance below which a chain is cut (a verified row costs more at a larger batch,
so each bucket learns its own price). Under ``--speculative auto``, ``none`` (plain decoding)
is one of the arms, so the bandit itself learns where speculation stops paying; a fixed method
has one arm (its proposer at ``num_draft_tokens``) and no learning. Reward = tokens committed
per second of the step (drafting + verify + acceptance, as the engine measured it). Per bucket
the policy is ε-greedy over the MEDIAN reward of each arm's recent ``window`` steps (robust to
the noisy, shared CPU); every arm is tried ``min_trials`` times first (speculative ones before
plain). Above ``max_batch`` running sequences nothing speculates (a hard switch, no exploration
cost at large batches).

Proposers that are known to have no drafts this step are ``idle`` and their arms are not
candidates. The n-gram proposer is free to ask and most steps it has nothing (it drafts on a
fifth of the steps at batch 1 on the benchmark's chat prompts): an n-gram arm chosen then would
run a plain step, its median reward would be a plain step's, and the steps where it does draft
would never decide anything. Asked first (``SpecDecoder``), its arms are chosen only when it
drafts and are measured only on those steps; the other arms' speeds do not depend on it and
are shared.

Exploration decays per bucket, ε = max(ε_min, ε · decay / (decay + steps)): it is needed while
the medians are young and is a tax afterwards (an explored arm that loses costs up to 2x a plain
step here); ε_min keeps re-measuring arms whose speed drifts (drafter swaps also ``forget``).
An explored step takes the candidate tried least recently, so every arm stays fresh.

Done better than TLT's fastrl bandit: the plain-decoding arm is learned, not assumed off below a
threshold; untried arms are explored before exploiting; the random stream is seeded.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tlt_serve.engine.stats import BUCKETS, bucket_name, bucket_of


@dataclass(frozen=True, order=True)
class Strategy:
    proposer: str  # none | ngram | suffix | drafter | suffix+drafter
    depth: int = 0  # draft depth (a chain's length); 0 for none
    topk: int = 1  # > 1: a tree, expanding the top-k children of each frontier node
    budget: int = 0  # tree nodes verified per request (trees only)
    # Chains of proposers that estimate each draft's acceptance (suffix): the chain is cut
    # where the estimate falls below this (a price per verified row; 0: the proposer's own).
    min_prob: float = 0.0

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def __str__(self) -> str:
        if self.proposer == "none":
            return "none"
        if self.is_tree:
            return f"{self.proposer}:{self.depth}x{self.topk}/{self.budget}"
        cut = f"@{self.min_prob:g}" if self.min_prob else ""
        return f"{self.proposer}:{self.depth}{cut}"


PLAIN = Strategy("none")


@dataclass
class _Bucket:
    """What one batch-size bucket has measured."""

    arms: list[Strategy]
    window: int
    rewards: dict[Strategy, deque[float]] = field(init=False)
    tried_at: dict[Strategy, int] = field(init=False)  # step of each arm's last trial
    steps: int = 0

    def __post_init__(self) -> None:
        self.rewards = {a: deque(maxlen=self.window) for a in self.arms}
        self.tried_at = {a: -1 for a in self.arms}


class StrategyBandit:
    def __init__(
        self,
        arms: list[Strategy],
        max_batch: int,
        epsilon: float = 0.1,
        window: int = 64,
        min_trials: int = 3,
        seed: int = 0,
        epsilon_min: float = 0.02,
        decay_steps: int = 200,
    ) -> None:
        self.arms = list(dict.fromkeys(arms))  # empty: always plain; one arm: fixed strategy
        self.max_batch = max_batch
        self.epsilon, self.epsilon_min, self.decay_steps = epsilon, epsilon_min, decay_steps
        self.min_trials = min_trials
        self._rng = random.Random(seed)
        self._buckets = [_Bucket(self.arms, window) for _ in range(len(BUCKETS) + 1)]

    def epsilon_at(self, steps: int) -> float:
        """Exploration probability after ``steps`` steps of a bucket."""
        decayed = self.epsilon * self.decay_steps / (self.decay_steps + steps)
        return max(self.epsilon_min, decayed)

    def choose(self, batch_size: int, idle: Iterable[str] = ()) -> Strategy:
        """The strategy for a step of ``batch_size`` rows; ``idle``: proposers known to have
        no drafts this step (their arms would be plain steps)."""
        if batch_size > self.max_batch or not self.arms:
            return PLAIN
        if len(self.arms) == 1:
            return self.arms[0]
        b = self._buckets[bucket_of(batch_size)]
        b.steps += 1
        skip = set(idle)
        candidates = [a for a in self.arms if a.proposer not in skip] or [PLAIN]
        # Untried arms first, speculative ones before plain decoding (whose speed is least in
        # doubt): a small batch starts speculating on its first steps.
        for arm in sorted(candidates, key=lambda a: a == PLAIN):
            if len(b.rewards.get(arm, ())) < self.min_trials:
                return self._tried(b, arm)
        best = max(candidates, key=lambda a: statistics.median(b.rewards[a]))
        if len(candidates) > 1 and self._rng.random() < self.epsilon_at(b.steps):
            others = [a for a in candidates if a != best]
            return self._tried(b, min(others, key=lambda a: b.tried_at[a]))
        return self._tried(b, best)

    @staticmethod
    def _tried(b: _Bucket, arm: Strategy) -> Strategy:
        if arm in b.tried_at:
            b.tried_at[arm] = b.steps
        return arm

    def update(self, batch_size: int, arm: Strategy, tokens: int, seconds: float) -> None:
        if batch_size > self.max_batch or seconds <= 0:
            return
        window = self._buckets[bucket_of(batch_size)].rewards.get(arm)
        if window is not None:
            window.append(tokens / seconds)

    def forget(self, proposer: str) -> None:
        """Drop the measurements of ``proposer``'s arms (e.g. its model changed)."""
        for b in self._buckets:
            for arm, window in b.rewards.items():
                if arm.proposer == proposer:
                    window.clear()

    def table(self) -> dict[str, dict[str, float]]:
        """Median reward (tokens/s) per bucket and arm, for /get_server_info and benchmarks."""
        out: dict[str, dict[str, float]] = {}
        for i in range(bucket_of(self.max_batch) + 1):
            seen = {str(a): statistics.median(r) for a, r in self._buckets[i].rewards.items() if r}
            if seen:
                out[bucket_name(i)] = {a: round(v, 1) for a, v in seen.items()}
        return out
