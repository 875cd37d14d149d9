"""Which speculation strategy a decode step uses: an online bandit per batch-size bucket.

A strategy is (proposer, depth). Under ``--speculative auto``, ``none`` (plain decoding) is one
of the arms, so the bandit itself learns where speculation stops paying; a fixed method has one
arm (its proposer at ``num_draft_tokens``) and no learning. Reward = tokens committed per second
of the step (drafting + verify + acceptance, as the engine measured it). Per bucket the policy
is ε-greedy over the MEDIAN reward of each arm's recent ``window`` steps (robust to the noisy,
shared CPU); every arm is tried ``min_trials`` times first. Above ``max_batch`` running
sequences nothing speculates (a hard switch, no exploration cost at large batches).

Done better than TLT's fastrl bandit: the plain-decoding arm is learned, not assumed off below a
threshold; untried arms are explored before exploiting; the random stream is seeded.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from dataclasses import dataclass

# Upper bounds of batch-size buckets: 1, 2-4, 5-8, 9-16, 17-32, 33-64, 65+.
BUCKETS = (1, 4, 8, 16, 32, 64)


@dataclass(frozen=True, order=True)
class Strategy:
    proposer: str  # none | ngram | drafter
    depth: int = 0  # draft depth (a chain's length); 0 for none
    topk: int = 1  # > 1: a tree, expanding the top-k children of each frontier node
    budget: int = 0  # tree nodes verified per request (trees only)

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def __str__(self) -> str:
        if self.proposer == "none":
            return "none"
        if self.is_tree:
            return f"{self.proposer}:{self.depth}x{self.topk}/{self.budget}"
        return f"{self.proposer}:{self.depth}"


PLAIN = Strategy("none")


class StrategyBandit:
    def __init__(
        self,
        arms: list[Strategy],
        max_batch: int,
        epsilon: float = 0.1,
        window: int = 64,
        min_trials: int = 3,
        seed: int = 0,
    ) -> None:
        self.arms = list(dict.fromkeys(arms))  # empty: always plain; one arm: fixed strategy
        self.max_batch = max_batch
        self.epsilon = epsilon
        self.min_trials = min_trials
        self._rng = random.Random(seed)
        self._rewards = [
            {a: deque[float](maxlen=window) for a in self.arms} for _ in range(len(BUCKETS) + 1)
        ]

    @staticmethod
    def bucket(batch_size: int) -> int:
        return bisect.bisect_left(BUCKETS, batch_size)

    def choose(self, batch_size: int) -> Strategy:
        if batch_size > self.max_batch or not self.arms:
            return PLAIN
        if len(self.arms) == 1:
            return self.arms[0]
        seen = self._rewards[self.bucket(batch_size)]
        for arm in self.arms:
            if len(seen[arm]) < self.min_trials:
                return arm
        if self._rng.random() < self.epsilon:
            return self._rng.choice(self.arms)
        return max(self.arms, key=lambda a: statistics.median(seen[a]))

    def update(self, batch_size: int, arm: Strategy, tokens: int, seconds: float) -> None:
        window = self._rewards[self.bucket(batch_size)].get(arm)
        if window is not None and batch_size <= self.max_batch and seconds > 0:
            window.append(tokens / seconds)

    def forget(self, proposer: str) -> None:
        """Drop the measurements of ``proposer``'s arms (e.g. its model changed)."""
        for bucket in self._rewards:
            for arm, window in bucket.items():
                if arm.proposer == proposer:
                    window.clear()

    def table(self) -> dict[str, dict[str, float]]:
        """Median reward (tokens/s) per bucket and arm, for /get_server_info and benchmarks."""
        out: dict[str, dict[str, float]] = {}
        lows = (1, *(b + 1 for b in BUCKETS))
        highs: tuple[int | None, ...] = (*BUCKETS, None)
        for i, (lo, hi) in enumerate(zip(lows, highs, strict=True)):
            if lo > self.max_batch:
                break
            name = str(lo) if lo == hi else f"{lo}-{hi if hi is not None else ''}"
            seen = {str(a): statistics.median(r) for a, r in self._rewards[i].items() if r}
            if seen:
                out[name] = {a: round(v, 1) for a, v in seen.items()}
        return out
