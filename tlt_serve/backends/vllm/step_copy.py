"""The drafter's inputs of each step, kept per request on the host without stalling the step.

vLLM hands its EAGLE drafter, each step, the target's tokens, positions and final hidden
states of the step's rows: prompt chunks whole, and of a verify step's [last token, drafts]
rows the accepted prefix (the count of rejected rows per request is a device tensor). On a
GPU, reading that count or the rows on the host would wait for the step's kernels. Instead
``add`` queues copies of the rows into pinned host memory behind the step's work on its
stream and records an event; a later ``add`` or ``take`` trims the copies whose event has
passed to the kept rows. Nothing waits except ``take`` (between two steps, for copies still
in flight). On a CPU the tensors are already on the host and are trimmed at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

Segment = tuple[int, torch.Tensor, torch.Tensor]  # first position, tokens [m], features [m, H]


@dataclass
class _Step:
    done: Any  # torch.cuda.Event recorded after the copies (None: on the host already)
    rids: list[str]  # the step's requests, in row order
    starts: list[int]  # [R + 1] first row of each request
    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H]
    rejected: torch.Tensor | None  # [R] rows rejected at each request's end


def _host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor ``t``, queued on the current stream."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class StepCopies:
    def __init__(self) -> None:
        self.pending: deque[_Step] = deque()
        self.segments: dict[str, list[Segment]] = {}

    def add(self, rids: list[str], starts: list[int], tokens: torch.Tensor,
            positions: torch.Tensor, hidden: torch.Tensor,
            rejected: torch.Tensor | None) -> None:
        """Keep the step's rows: ``tokens`` [≥T], ``positions`` [≥T], ``hidden`` [≥T, H] with
        T = ``starts[-1]``, of requests ``rids`` (rows ``starts[r]:starts[r + 1]``);
        ``rejected`` [R] or None. The caller may reuse every tensor after the call."""
        T = starts[-1]
        tok, pos, hid = tokens[:T].detach(), positions[:T].detach(), hidden[:T].detach()
        rej = None if rejected is None else rejected.detach()
        done = None
        if hid.device.type == "cuda":
            tok, pos, hid = _host(tok), _host(pos), _host(hid)
            rej = None if rej is None else _host(rej)
            done = torch.cuda.Event()
            done.record()
        self.pending.append(_Step(done, list(rids), list(starts), tok, pos, hid, rej))
        self.settle(wait=False)

    def settle(self, wait: bool) -> None:
        """Trim the steps whose copies have landed (all of them if ``wait``), in order."""
        while self.pending:
            step = self.pending[0]
            if step.done is not None:
                if wait:
                    step.done.synchronize()
                elif not step.done.query():
                    return
            self.pending.popleft()
            self._keep(step)

    def _keep(self, step: _Step) -> None:
        rejected = ([0] * len(step.rids) if step.rejected is None
                    else step.rejected.tolist())
        for r, rid in enumerate(step.rids):
            a = step.starts[r]
            keep = step.starts[r + 1] - a - rejected[r]
            if keep > 0:
                self.segments.setdefault(rid, []).append(
                    (int(step.positions[a]), step.tokens[a:a + keep].clone(),
                     step.hidden[a:a + keep].clone()))

    def take(self, rid: str) -> list[Segment]:
        """The kept segments of ``rid`` in position order, forgotten here."""
        self.settle(wait=True)
        return sorted(self.segments.pop(rid, []), key=lambda s: s[0])

    def drop(self, rid: str) -> None:
        self.settle(wait=True)
        self.segments.pop(rid, None)
