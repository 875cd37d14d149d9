"""The promotion guard: is a candidate drafter better than the one being served?

Both are scored on the same held-out recent samples (offline accept length of greedy chains,
``evaluate.offline_accept``), one packed row per ``step`` so the trainer stays interruptible.
A candidate must gain at least ``min_gain`` accepted tokens per chain to be published; on
sampled (non-greedy) held-out data the figure is a proxy (drafts are compared with the
target's argmax along the served path), which is fair between the two drafters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tlt_serve.speculative.drafter import DrafterModel
from trainer.data import Sample
from trainer.evaluate import HeldOut, offline_accept, prepare_heldout
from trainer.packing import batches


@dataclass(frozen=True)
class Verdict:
    step: int  # trainer step of the candidate
    candidate: float  # offline accept length
    served: float
    chains: int
    promote: bool

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "candidate": round(self.candidate, 4),
                "served": round(self.served, 4), "chains": self.chains,
                "published": self.promote}


class Evaluation:
    """One comparison in progress."""

    def __init__(
        self,
        candidate: DrafterModel,
        served: DrafterModel,
        heldout: Sequence[Sample],
        step: int,
        row_len: int,
        rows: int,
        depth: int,
        min_gain: float,
    ) -> None:
        self.candidate, self.served, self.step = candidate, served, step
        self.depth, self.min_gain = depth, min_gain
        packed = batches(heldout, row_len, 1, None)[-rows:]
        self.pieces: list[HeldOut] = prepare_heldout(candidate, packed)
        self.done = 0
        self.cand_sum = self.base_sum = 0.0
        self.chains = 0

    def advance(self) -> Verdict | None:
        """Score the next piece; the verdict once all are scored."""
        if self.done < len(self.pieces):
            piece = [self.pieces[self.done]]
            cand = offline_accept(self.candidate, piece, self.depth)
            base = offline_accept(self.served, piece, self.depth)
            self.cand_sum += cand.accept_length * cand.chains
            self.base_sum += base.accept_length * base.chains
            self.chains += cand.chains
            self.done += 1
        if self.done < len(self.pieces):
            return None
        n = max(self.chains, 1)
        cand_score, base_score = self.cand_sum / n, self.base_sum / n
        promote = self.chains > 0 and cand_score >= base_score + self.min_gain
        return Verdict(self.step, cand_score, base_score, self.chains, promote)
