"""Which speculation strategy a decode step uses: an online bandit per batch-size bucket.

A strategy is (proposer, depth), for trees also top-k and budget, for suffix chains also the
estimated acceptance below which a chain is cut (a verified row costs more at a larger batch,
so each bucket learns its own price). Under ``--speculative auto``, ``none`` (plain decoding)
is one of the arms, so the bandit itself learns where speculation stops paying; a fixed method
has one arm (its proposer at ``num_draft_tokens``) and no learning. Reward = tokens committed
per second of the step (drafting + verify + acceptance, as the engine measured it). Per bucket
the policy is ε-greedy over the MEDIAN reward of each arm's recent ``window`` steps (robust to
the noisy, shared CPU), among arms measured ``min_trials`` times. Above ``max_batch`` running
sequences nothing speculates (a hard switch, no exploration cost at large batches).

Proposers that are known to have no drafts this step are ``idle`` and their arms are not
candidates. The n-gram proposer is free to ask and most steps it has nothing (it drafts on a
fifth of the steps at batch 1 on the benchmark's chat prompts): an n-gram arm chosen then would
run a plain step, its median reward would be a plain step's, and the steps where it does draft
would never decide anything. Asked first (``SpecDecoder``), its arms are chosen only when it
drafts and are measured only on those steps; the other arms' speeds do not depend on it and
are shared.

Exploration is paid for out of what speculation wins. Plain decoding is measured first in each
bucket (three steps): it is the yardstick, free to measure. Each speculative step then books
the time it lost against it (its seconds less the seconds plain decoding would have taken to
commit its tokens; negative when it won). An arm is explored (its trials, or by ε) only while
the bucket's booked loss stays within ``budget`` of the bucket's time plus ``grace`` plain
steps: where every arm loses (batch 4 and more on a CPU) exploration stops after a couple of
trials and the policy runs plain decoding, costing at most ~``budget``; where an arm wins
(batch 1) its wins fund the trials of the others. Trials go to an arm ahead of plain so far
first (a winner is confirmed, then exploited), then to each arm once before any twice; an arm
slower than ``prune`` x plain in its better of two trials is owed no more (ε may still
re-measure it). A step books at most two plain steps' loss (a first use's one-off costs, such
as a drafter catching up over a long prompt, are not an arm's price).

Exploration decays per bucket, ε = max(ε_min, ε · decay / (decay + steps)): it is needed while
the medians are young and is a tax afterwards (an explored arm that loses costs up to 2x a plain
step here); ε_min keeps re-measuring arms whose speed drifts (drafter swaps also ``forget``).
An explored step takes the candidate tried least recently, so every arm stays fresh.

Done better than TLT's fastrl bandit: the plain-decoding arm is learned, not assumed off below a
threshold; exploration has a price and a budget; the random stream is seeded.
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
    plain_seconds: deque[float] = field(init=False)  # recent plain steps' durations
    steps: int = 0
    elapsed: float = 0.0  # seconds of every step measured here
    lost: float = 0.0  # seconds speculative steps lost against plain decoding (< 0: won)

    def __post_init__(self) -> None:
        self.rewards = {a: deque(maxlen=self.window) for a in self.arms}
        self.tried_at = {a: -1 for a in self.arms}
        self.plain_seconds = deque(maxlen=self.window)


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
        budget: float = 0.015,
        grace: float = 0.5,
        prune: float = 0.8,
    ) -> None:
        self.arms = list(dict.fromkeys(arms))  # empty: always plain; one arm: fixed strategy
        self.max_batch = max_batch
        self.epsilon, self.epsilon_min, self.decay_steps = epsilon, epsilon_min, decay_steps
        self.min_trials = min_trials
        self.budget, self.grace, self.prune = budget, grace, prune
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
        if PLAIN in b.rewards and len(b.rewards[PLAIN]) < self.min_trials:
            return self._tried(b, PLAIN)  # the yardstick first
        affordable = self._affordable(b)
        trials = [a for a in candidates if self._promising(b, a)]
        if affordable and trials:  # an arm ahead so far first, then each once before any twice
            return self._tried(b, min(trials, key=lambda a: (not self._ahead(b, a),
                                                              len(b.rewards[a]))))
        measured = [a for a in candidates if len(b.rewards.get(a, ())) >= self.min_trials]
        if not measured:
            return self._tried(b, PLAIN if PLAIN in b.rewards else candidates[0])
        best = max(measured, key=lambda a: statistics.median(b.rewards[a]))
        others = [a for a in candidates if a != best and (affordable or a == PLAIN)]
        if others and self._rng.random() < self.epsilon_at(b.steps):
            return self._tried(b, min(others, key=lambda a: b.tried_at[a]))
        return self._tried(b, best)

    def _promising(self, b: _Bucket, arm: Strategy) -> bool:
        """Whether an arm is owed a trial: measured fewer than ``min_trials`` times and, after
        two trials, the better one not slower than ``prune`` x plain decoding (one trial can
        carry an arm's one-off costs: a drafter's first catch-up over a whole prompt)."""
        seen = b.rewards.get(arm)
        if seen is None or len(seen) >= self.min_trials:
            return False
        plain = b.rewards.get(PLAIN)
        if len(seen) < 2 or not plain:
            return True
        return max(seen) >= self.prune * statistics.median(plain)

    @staticmethod
    def _ahead(b: _Bucket, arm: Strategy) -> bool:
        """Whether an arm's trials so far beat plain decoding's median."""
        seen, plain = b.rewards.get(arm), b.rewards.get(PLAIN)
        if not seen or not plain or arm == PLAIN:
            return False
        return statistics.median(seen) > statistics.median(plain)

    def _affordable(self, b: _Bucket) -> bool:
        """Whether a bucket may try a speculative arm: what speculation lost there is within
        ``budget`` of its time plus ``grace`` plain steps (no yardstick: always)."""
        if not b.plain_seconds:
            return True
        allowance = self.budget * b.elapsed + self.grace * statistics.median(b.plain_seconds)
        return b.lost <= allowance

    @staticmethod
    def _tried(b: _Bucket, arm: Strategy) -> Strategy:
        if arm in b.tried_at:
            b.tried_at[arm] = b.steps
        return arm

    def update(self, batch_size: int, arm: Strategy, tokens: int, seconds: float) -> None:
        if batch_size > self.max_batch or seconds <= 0:
            return
        b = self._buckets[bucket_of(batch_size)]
        window = b.rewards.get(arm)
        if window is None:
            return
        b.elapsed += seconds
        if arm == PLAIN:
            b.plain_seconds.append(seconds)
        elif b.rewards.get(PLAIN) and b.plain_seconds:
            # at most two plain steps a step: a first use's one-off costs are not its price
            cap = 2 * statistics.median(b.plain_seconds)
            b.lost += min(cap, seconds - tokens / statistics.median(b.rewards[PLAIN]))
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
