"""Which speculation strategy a decode step uses: an online bandit per batch-size bucket.

A strategy is (proposer, depth), for trees also top-k and budget, for suffix chains also the
estimated acceptance below which a chain is cut (a verified row costs more at a larger batch,
so each bucket learns its own price). Under ``--speculative auto``, ``none`` (plain decoding)
is one of the arms, so the bandit itself learns where speculation stops paying; a fixed method
has one arm (its proposer at ``num_draft_tokens``) and no learning. An arm's value = tokens
committed per second per running sequence over its recent ``window`` steps (drafting + verify +
acceptance, as the engine measured them): a ratio of sums, so the rare slow steps of an arm
count (a drafter catching up over a new turn's prompt; a median of per-step rates hid them and
ranked arms that lost on the whole above plain decoding), with each step's seconds capped at
16x the window's median (a step the shared host preempted for long is not the arm's price); per
sequence, as a bucket spans several batch sizes. Per bucket the policy is ε-greedy over these
values, among arms measured ``min_trials`` times. Above ``max_batch`` running sequences nothing
speculates (a hard switch, no exploration cost at large batches).

Proposers that are known to have no drafts this step are ``idle`` and their arms are not
candidates. The n-gram proposer is free to ask and most steps it has nothing (it drafts on a
fifth of the steps at batch 1 on the benchmark's chat prompts): an n-gram arm chosen then would
run a plain step, its value would be a plain step's, and the steps where it does draft
would never decide anything. Asked first (``SpecDecoder``), its arms are chosen only when it
drafts and are measured only on those steps; the other arms' speeds do not depend on it and
are shared.

Exploration is paid for out of what speculation wins. Plain decoding is measured first in each
bucket (three steps): it is the yardstick, free to measure. Each speculative step then books
the time it lost against it (its seconds less the seconds plain decoding would have taken to
commit its tokens; negative when it won). An arm is explored (its trials, or by ε) only while
the bucket's booked loss stays within ``budget`` of the bucket's time plus ``grace`` plain
steps: where every arm loses (several sequences on a CPU) exploration stops after a couple of
trials and the policy runs plain decoding, costing at most ~``budget``; where an arm wins
(batch 1) its wins fund the trials of the others. Trials go to an arm ahead of plain so far
first (a winner is confirmed, then exploited), then to each arm once before any twice; an arm
slower than ``prune`` x plain in its better of two trials is owed no more (ε may still
re-measure it).

A speculative arm is exploited only while its value is ``margin`` above plain decoding's (at
par, within the noise of a shared host, plain decoding is the safe choice) and the loss it
booked itself is within the bucket's allowance (what the values misjudge stays bounded; the
credit a winning arm books is capped at ``budget`` of the bucket's time), and plain decoding is
re-measured every ``refresh`` steps of the bucket meanwhile: the host's speed drifts, and a
yardstick measured in a slow spell made arms that lost look ahead.

Exploration decays per bucket, ε = max(ε_min, ε · decay / (decay + steps)): it is needed while
the values are young and is a tax afterwards (an explored arm that loses costs up to 2x a plain
step here); ε_min keeps re-measuring arms whose speed drifts (drafter swaps also ``forget``).
An explored step takes the candidate tried least recently, so every arm stays fresh.

Done better than TLT's fastrl bandit: the plain-decoding arm is learned, not assumed off below a
threshold; exploration has a price and a budget; the random stream is seeded.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
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


SLOW_CAP = 16.0  # a step counts at most this many times its arm's median step
# ... a plain step at most this many: plain decoding has no rare slow steps of its own (no
# catch-up), so a slower one is the host's, and counted whole it made every arm that lost
# look ahead of the yardstick until it left the window (refreshed a step at a time).
PLAIN_CAP = 2.0


class _Window:
    """An arm's recent steps in one bucket: (tokens committed per running sequence, seconds);
    its figures are computed once per step added (the policy reads them many times a step)."""

    def __init__(self, size: int, cap: float = SLOW_CAP) -> None:
        self.steps: deque[tuple[float, float]] = deque(maxlen=size)
        self.cap = cap  # a step's seconds count at most this many times the median
        self._figures: tuple[float, float, float] | None = None  # median s, rate, best

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, tokens_per_seq: float, seconds: float) -> None:
        self.steps.append((tokens_per_seq, seconds))
        self._figures = None

    def clear(self) -> None:
        self.steps.clear()
        self._figures = None

    def _computed(self) -> tuple[float, float, float]:
        if self._figures is None:
            median = statistics.median(s for _, s in self.steps)
            cap = self.cap * median
            rate = sum(t for t, _ in self.steps) / sum(min(s, cap) for _, s in self.steps)
            self._figures = (median, rate, max(t / s for t, s in self.steps))
        return self._figures

    def median_seconds(self) -> float:
        return self._computed()[0]

    def rate(self) -> float:
        """Tokens per second per sequence over the window: a ratio of sums (what the arm
        yields in the long run, its rare slow steps included: a drafter catching up over a
        new turn's prompt), each step's seconds capped at ``SLOW_CAP`` x the window's median
        (a step the host preempted for long is not the arm's price; plain decoding's at
        ``PLAIN_CAP`` x)."""
        return self._computed()[1]

    def best(self) -> float:
        """The fastest step's rate."""
        return self._computed()[2]


@dataclass
class _Bucket:
    """What one batch-size bucket has measured."""

    arms: list[Strategy]
    window: int
    rewards: dict[Strategy, _Window] = field(init=False)
    tried_at: dict[Strategy, int] = field(init=False)  # step of each arm's last trial
    steps: int = 0
    elapsed: float = 0.0  # seconds of every step measured here
    lost: float = 0.0  # seconds speculative steps lost against plain decoding (< 0: won)
    arm_lost: dict[Strategy, float] = field(init=False)  # the same per arm, credit capped

    def __post_init__(self) -> None:
        self.rewards = {a: _Window(self.window, PLAIN_CAP if a == PLAIN else SLOW_CAP)
                        for a in self.arms}
        self.tried_at = {a: -1 for a in self.arms}
        self.arm_lost = {a: 0.0 for a in self.arms}


class StrategyBandit:
    def __init__(
        self,
        arms: list[Strategy],
        max_batch: int,
        epsilon: float = 0.1,
        window: int = 32,
        min_trials: int = 3,
        seed: int = 0,
        epsilon_min: float = 0.02,
        decay_steps: int = 200,
        budget: float = 0.015,
        grace: float = 0.5,
        prune: float = 0.8,
        margin: float = 0.1,
        refresh: int = 24,
    ) -> None:
        self.arms = list(dict.fromkeys(arms))  # empty: always plain; one arm: fixed strategy
        self.max_batch = max_batch
        self.epsilon, self.epsilon_min, self.decay_steps = epsilon, epsilon_min, decay_steps
        self.min_trials = min_trials
        self.budget, self.grace, self.prune = budget, grace, prune
        self.margin, self.refresh = margin, refresh
        self._rng = random.Random(seed)
        self._buckets = [_Bucket(self.arms, window) for _ in range(len(BUCKETS) + 1)]

    def epsilon_at(self, steps: int) -> float:
        """Exploration probability after ``steps`` steps of a bucket."""
        decayed = self.epsilon * self.decay_steps / (self.decay_steps + steps)
        return max(self.epsilon_min, decayed)

    def choose(self, batch_size: int, idle: Iterable[str] = (),
               upfront: Mapping[str, float] | None = None) -> Strategy:
        """The strategy for a step of ``batch_size`` rows; ``idle``: proposers known to have
        no drafts this step (their arms would be plain steps); ``upfront``: seconds a
        proposer would spend this step before drafting (a drafter catching up over a new
        prompt), which a trial of its arms must fit in the allowance."""
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
        # an arm may be tried while what speculation lost here, plus what the arm spends
        # before drafting, fits the allowance
        allowance, cost = self._allowance(b), upfront or {}
        affordable = {a: b.lost + cost.get(a.proposer, 0.0) <= allowance for a in candidates}
        trials = [a for a in candidates if affordable[a] and self._promising(b, a)]
        if trials:  # an arm ahead so far first, then each once before any twice
            return self._tried(b, min(trials, key=lambda a: (not self._ahead(b, a),
                                                              len(b.rewards[a]))))
        measured = [a for a in candidates if len(b.rewards.get(a, ())) >= self.min_trials]
        if not measured:
            return self._tried(b, PLAIN if PLAIN in b.rewards else candidates[0])
        best = max(measured, key=lambda a: b.rewards[a].rate())
        plain = b.rewards.get(PLAIN)
        if plain and best != PLAIN:
            if (b.rewards[best].rate() < (1 + self.margin) * plain.rate()
                    or b.arm_lost[best] > allowance):
                best = PLAIN  # speculation must win clearly, and what it lost stays bounded
            elif b.steps - b.tried_at[PLAIN] >= self.refresh:
                return self._tried(b, PLAIN)  # the yardstick kept fresh (the host drifts)
        others = [a for a in candidates if a != best and (affordable[a] or a == PLAIN)]
        if others and self._rng.random() < self.epsilon_at(b.steps):
            return self._tried(b, min(others, key=lambda a: b.tried_at[a]))
        return self._tried(b, best)

    def _promising(self, b: _Bucket, arm: Strategy) -> bool:
        """Whether an arm is owed a trial: measured fewer than ``min_trials`` times and, after
        two trials, the better one not slower than ``prune`` x plain decoding (one trial can
        carry an arm's one-off costs: a drafter's first catch-up over a whole prompt); or
        ahead of plain decoding but not by ``margin`` after them (up to twice as many)."""
        seen = b.rewards.get(arm)
        if seen is None or arm == PLAIN:
            return False
        plain = b.rewards.get(PLAIN)
        if not plain:
            return len(seen) < self.min_trials
        if len(seen) >= self.min_trials:  # ahead of plain but not by the margin: more trials
            return (len(seen) < 2 * self.min_trials
                    and plain.rate() < seen.rate() < (1 + self.margin) * plain.rate())
        if len(seen) < 2:
            return True
        return seen.best() >= self.prune * plain.rate()

    @staticmethod
    def _ahead(b: _Bucket, arm: Strategy) -> bool:
        """Whether a speculative arm's trials so far beat plain decoding."""
        seen, plain = b.rewards.get(arm), b.rewards.get(PLAIN)
        if not seen or not plain:
            return False
        return seen.rate() > plain.rate()

    def _allowance(self, b: _Bucket) -> float:
        """Seconds speculation may lose against plain decoding in a bucket: ``budget`` of its
        time plus ``grace`` plain steps (no yardstick yet: any)."""
        plain = b.rewards.get(PLAIN)
        if not plain:
            return float("inf")
        return self.budget * b.elapsed + self.grace * plain.median_seconds()

    @staticmethod
    def _tried(b: _Bucket, arm: Strategy) -> Strategy:
        if arm in b.tried_at:
            b.tried_at[arm] = b.steps
        return arm

    def update(self, batch_size: int, arm: Strategy, tokens: int, seconds: float) -> None:
        """A step of ``batch_size`` sequences ran ``arm`` and committed ``tokens`` in
        ``seconds``."""
        if batch_size > self.max_batch or seconds <= 0:
            return
        b = self._buckets[bucket_of(batch_size)]
        window = b.rewards.get(arm)
        if window is None:
            return
        per_seq = tokens / batch_size  # rates per sequence: a bucket spans several batch sizes
        b.elapsed += seconds
        plain = b.rewards.get(PLAIN)
        if arm != PLAIN and plain:
            cap = SLOW_CAP * plain.median_seconds()  # as in the values: preemption is not
            loss = min(cap, seconds - per_seq / plain.rate())
            b.lost += loss
            # each arm's own record bounds its exploitation; the credit it earns is capped
            b.arm_lost[arm] = max(b.arm_lost[arm] + loss, -self.budget * b.elapsed)
        window.add(per_seq, seconds)

    def forget(self, proposer: str) -> None:
        """Drop the measurements of ``proposer``'s arms (e.g. its model changed)."""
        for b in self._buckets:
            for arm, window in b.rewards.items():
                if arm.proposer == proposer:
                    window.clear()

    def table(self) -> dict[str, dict[str, float]]:
        """Tokens/s per running sequence per bucket and arm (over each arm's window), for
        /get_server_info and benchmarks."""
        out: dict[str, dict[str, float]] = {}
        for i in range(bucket_of(self.max_batch) + 1):
            seen = {str(a): w.rate() for a, w in self._buckets[i].rewards.items() if w}
            if seen:
                out[bucket_name(i)] = {a: round(v, 1) for a, v in seen.items()}
        return out
