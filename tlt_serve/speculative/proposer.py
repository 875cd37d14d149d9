"""The proposer interface and the model-free proposers (none, n-gram).

A proposer drafts up to ``k`` tokens per running request before a verify step. It reads the
requests (never mutates them): its per-request state syncs lazily from ``Request`` tokens, so
it only needs to hear about what the engine alone knows:

- ``observe(req, features)``: target features of the positions whose next token is now
  committed (drafters only: ``needs_features``), after every target forward;
- ``release(req)``: the request finished or was aborted (its state can go);
- ``move_row(src, dst, length)``: the scheduler compacted KV rows (proposers with their own
  per-row cache follow it);
- ``weights_changed()``: the target's weights were updated (drafts from what the old weights
  wrote predict the new ones less).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from tlt_serve.engine.draft_tree import DraftTree
from tlt_serve.engine.request import Request
from tlt_serve.speculative.ngram import NgramConfig, NgramProposer


class Proposer(Protocol):
    name: str
    needs_features: bool

    def observe(self, req: Request, features: torch.Tensor) -> None: ...

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """``ks[b]`` (>= 0) caps request b's draft; returns up to that many tokens each."""
        ...

    def release(self, req: Request) -> None: ...

    def move_row(self, src: int, dst: int, length: int) -> None: ...

    def weights_changed(self) -> None: ...


@runtime_checkable
class TreeProposer(Protocol):
    def propose_tree(
        self, reqs: Sequence[Request], depth: int, topk: int, budgets: Sequence[int]
    ) -> list[DraftTree]:
        """A draft tree per request: ``budgets[b]`` nodes at most, ``depth`` deep, ``topk``
        children per node."""
        ...


class NoProposer:
    """Plain decoding: never drafts (the baseline every speedup is measured against)."""

    name = "none"
    needs_features = False

    def observe(self, req: Request, features: torch.Tensor) -> None:
        pass

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        return [[] for _ in reqs]

    def release(self, req: Request) -> None:
        pass

    def move_row(self, src: int, dst: int, length: int) -> None:
        pass

    def weights_changed(self) -> None:
        pass


class NgramDrafts:
    """``NgramProposer`` behind the interface: own history, live siblings, finished corpus."""

    name = "ngram"
    needs_features = False

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.ngram = NgramProposer(config)
        self._indexed: dict[str, int] = {}  # rid -> tokens of the request already indexed

    def observe(self, req: Request, features: torch.Tensor) -> None:
        pass

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        for req in reqs:
            self._sync(req)
        return [self.ngram.propose(r.rid, k) for r, k in zip(reqs, ks, strict=True)]

    def _sync(self, req: Request) -> None:
        done = self._indexed.get(req.rid)
        if done is None:
            self.ngram.add_request(req.rid, req.prompt_ids, req.group)
            done = len(req.prompt_ids)
        new = req.output_ids[done - len(req.prompt_ids) :]
        if new:
            self.ngram.append(req.rid, new)
        self._indexed[req.rid] = req.num_tokens

    def release(self, req: Request) -> None:
        if req.rid in self._indexed:
            self._sync(req)  # its last tokens join the corpus too
            del self._indexed[req.rid]
            self.ngram.finish(req.rid)

    def move_row(self, src: int, dst: int, length: int) -> None:
        pass

    def weights_changed(self) -> None:
        pass  # it drafts the most recent follower, already what the newest weights wrote
