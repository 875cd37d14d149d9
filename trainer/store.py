"""The online trainer's data: served sequences pulled from the server, newest target first.

Samples arrive tagged with the target weight version that produced them. Training draws
windows of at most ``row_len`` pairs with probability proportional to
``version_decay ** age`` (age: how many target versions came after the sample's), so after an
RL weight update the new target's samples dominate as soon as they exist, and samples more
than ``keep_versions`` versions old are dropped. Every ``heldout_every``-th sample (by capture
order) is held out for the promotion guard; the store keeps at most ``max_tokens`` training
tokens (oldest evicted first) and a proportional number of held-out ones; with ``max_bytes``
also at most that many bytes of features (a store on a GPU, fed by reference).
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tlt_serve.engine.capture import TrainingSample
from trainer.data import Sample
from trainer.packing import PackedBatch, Segment, make_batch, pack_rows


@dataclass(frozen=True)
class StoreConfig:
    max_tokens: int = 400_000  # training tokens kept (features ~1.2 KB/token in bf16 here)
    heldout_every: int = 10  # every n-th captured sample is held out
    version_decay: float = 0.25  # sampling weight factor per newer target version
    keep_versions: int = 3  # samples of older target versions are dropped
    min_response: int = 2  # shorter responses carry no training pair
    max_bytes: int = 0  # features kept (training + held-out); 0: only max_tokens bounds them

    def validate(self) -> None:
        checks = [
            ("store_max_tokens", self.max_tokens >= 1024, ">= 1024"),
            ("heldout_every", self.heldout_every >= 2, ">= 2"),
            ("version_decay", 0.0 <= self.version_decay <= 1.0, "in [0, 1]"),
            ("keep_versions", self.keep_versions >= 1, ">= 1"),
            ("store_max_bytes", self.max_bytes >= 0, ">= 0"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name}: must be {want}")


@dataclass(frozen=True, eq=False)
class Stored:
    sample: Sample
    weight_version: str


class SampleStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.train: deque[Stored] = deque()
        self.heldout: deque[Stored] = deque()
        self.versions: list[str] = []  # target versions in order of first appearance
        self.train_tokens = 0
        self._cum_weights: list[float] | None = None  # of ``train``, until it changes

    @property
    def newest_version(self) -> str | None:
        return self.versions[-1] if self.versions else None

    def add(self, samples: Sequence[TrainingSample]) -> int:
        """Keep the usable samples; returns how many were kept."""
        kept = 0
        for s in samples:
            if int(s.tokens.shape[0]) - s.prompt_len < self.config.min_response:
                continue
            if s.weight_version not in self.versions:
                self.versions.append(s.weight_version)
            item = Stored(Sample(s.tokens, s.features, s.prompt_len), s.weight_version)
            if s.seq % self.config.heldout_every == 0:
                self.heldout.append(item)
            else:
                self.train.append(item)
            kept += 1
        if kept:
            self._evict()
        return kept

    def _evict(self) -> None:
        live = set(self.versions[-self.config.keep_versions :])
        self.versions = [v for v in self.versions if v in live]
        cap, every = self.config.max_tokens, self.config.heldout_every
        # held-out samples get the share they have of captures: one in ``every``
        byte_cap = self.config.max_bytes or None
        held_bytes = None if byte_cap is None else max(byte_cap // every, 1)
        train_bytes = None if byte_cap is None or held_bytes is None else byte_cap - held_bytes
        self.train, self.train_tokens = _trim(self.train, live, cap, train_bytes)
        self.heldout, _ = _trim(self.heldout, live, max(cap // every, 1), held_bytes)
        self._cum_weights = None

    def age(self, version: str) -> int:
        return len(self.versions) - 1 - self.versions.index(version)

    def draw_batch(self, rows: int, row_len: int, rng: random.Random) -> PackedBatch | None:
        """``rows`` rows of windows drawn by version weight; None when nothing to train on."""
        if not self.train:
            return None
        samples = [s.sample for s in self.train]
        cum = self._weights()
        budget, segs = rows * row_len, []
        while budget > 0:
            i = rng.choices(range(len(samples)), cum_weights=cum)[0]
            seg = _window(samples[i], i, row_len, rng)
            segs.append(seg)
            budget -= seg.end - seg.start
        packed = pack_rows(segs, row_len, rng)[:rows]
        return make_batch(packed, samples)

    def _weights(self) -> list[float]:
        """Cumulative sampling weights of ``train``, recomputed only after it changed."""
        if self._cum_weights is None:
            ages = {v: self.age(v) for v in self.versions}
            weights = [self.config.version_decay ** ages[s.weight_version] for s in self.train]
            if not any(weights):
                weights = [1.0] * len(weights)
            self._cum_weights = list(itertools.accumulate(weights))
        return self._cum_weights

    def heldout_samples(self) -> list[Sample]:
        """Held-out samples of the newest target version (all held-out ones if none)."""
        newest = [s.sample for s in self.heldout if s.weight_version == self.newest_version]
        return newest or [s.sample for s in self.heldout]


def _trim(
    items: deque[Stored], live: set[str], cap: int, byte_cap: int | None
) -> tuple[deque[Stored], int]:
    """The live-version items, oldest dropped until at most ``cap`` tokens (and ``byte_cap``
    bytes of features) remain; the newest is always kept. Returns them and their tokens."""
    kept = deque(s for s in items if s.weight_version in live)
    total = sum(int(s.sample.tokens.shape[0]) for s in kept)
    size = sum(s.sample.features.nbytes for s in kept)
    while (total > cap or (byte_cap is not None and size > byte_cap)) and len(kept) > 1:
        old = kept.popleft().sample
        total -= int(old.tokens.shape[0])
        size -= old.features.nbytes
    return kept, total


def _window(sample: Sample, index: int, row_len: int, rng: random.Random) -> Segment:
    """A random window of at most ``row_len`` pairs that contains response pairs."""
    n = sample.num_pairs
    if n <= row_len:
        return Segment(index, 0, n)
    lo = max(sample.prompt_len - row_len, 0)  # the window must reach the response
    start = rng.randint(lo, n - row_len)
    return Segment(index, start, start + row_len)
