"""The engine's speculation step: when to draft, how many tokens, verify, feed the proposers.

``plan`` decides per decode batch: the policy (``speculative/policy.py``) picks a strategy — plain
decoding, or a proposer and a chain depth — for the running batch size (nothing speculates above
``max_batch``; under ``auto`` a bandit learns per batch-size bucket which strategy commits the
most tokens per second); a step without drafts is a plain step. Each request's draft is capped
so it never runs past ``max_new_tokens`` or the KV row. ``verify`` turns the target's logits
over [last token + drafts] into the tokens each request commits (``verify_chain``: exact for
greedy, rejection sampling otherwise). ``observe`` hands the proposers the target features of
every committed position (``engine/features.py``), from every forward (prefill, plain decode,
verify), so a drafter is always ready to catch up. ``end_step`` releases finished requests and
rewards the strategy with the step's measured tokens per second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt_serve.config import SpecConfig
from tlt_serve.engine.draft_tree import DraftTree
from tlt_serve.engine.features import Committed
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.engine.request import Request
from tlt_serve.engine.runner import ModelRunner, RunOutput
from tlt_serve.engine.scheduler import Emitted, ScheduledBatch
from tlt_serve.models.llama import LlamaModel
from tlt_serve.speculative.checkpoint import load_drafter
from tlt_serve.speculative.drafter import DrafterModel
from tlt_serve.speculative.drafter_proposer import DrafterProposer
from tlt_serve.speculative.ngram import NgramConfig
from tlt_serve.speculative.policy import PLAIN, Strategy, StrategyBandit
from tlt_serve.speculative.proposer import NgramDrafts, NoProposer, Proposer, TreeProposer
from tlt_serve.speculative.suffix import Draft, SuffixConfig
from tlt_serve.speculative.suffix_proposer import SuffixDrafts
from tlt_serve.speculative.tree import verify_tree
from tlt_serve.speculative.verify import ChainDrafts, verify_chain

FREE = ("suffix", "ngram")  # model-free proposers, asked before the policy chooses
COMBINED = "suffix+drafter"  # suffix drafts where it has one, the drafter's elsewhere


@dataclass(frozen=True)
class Plan:
    """One verify step's drafts: a tree per request (chains as one-child trees)."""

    trees: list[DraftTree]
    chain: bool  # every tree is a chain: the vectorised chain verifier applies


def _chain_drafts(run: RunOutput, drafts: list[list[int]], reqs: list[Request]) -> ChainDrafts:
    K, device = max(len(d) for d in drafts), run.logits.device
    padded = [d + [0] * (K - len(d)) for d in drafts]  # one copy to the device, not one per row
    return ChainDrafts(
        target_logits=run.logits[:, : K + 1],
        draft_tokens=torch.tensor(padded, dtype=torch.long, device=device),  # [B, K]
        num_drafts=torch.tensor([len(d) for d in drafts], device=device),  # [B]
        params=tuple(r.params for r in reqs),
    )


def _cut(draft: Draft, k: int, min_prob: float) -> list[int]:
    """A chain's first ``k`` drafts, as far as their estimated acceptance reaches
    ``min_prob`` (it only falls along a chain)."""
    n = sum(1 for p in draft.probs[:k] if p >= min_prob)
    return draft.tokens[:n]


class SpecDecoder:
    def __init__(
        self,
        config: SpecConfig,
        proposers: dict[str, Proposer],
        policy: StrategyBandit,
        max_len: int,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        self.config = config
        self.proposers = proposers
        self.policy = policy
        self.max_len = max_len
        self.feature_layers = feature_layers
        self._strategy = PLAIN  # what the current step runs (rewarded in end_step)
        # Under auto, the model-free proposer is asked for drafts at its deepest chain arm
        # (covering the combination's depths too) before the policy chooses.
        self._free = next((n for n in FREE if n in proposers), "")
        depths = [a.depth for a in policy.arms
                  if a.proposer in (self._free, COMBINED) and not a.is_tree]
        self._free_depth = max(depths) if len(policy.arms) > 1 and depths else 0

    @property
    def enabled(self) -> bool:
        return len(self.proposers) > 1

    @property
    def proposer_name(self) -> str:
        """none | ngram | suffix | drafter | auto (several, chosen per step)."""
        names = [n for n in self.proposers if n != PLAIN.proposer]
        return "none" if not names else names[0] if len(names) == 1 else "auto"

    def plan(self, batch: ScheduledBatch) -> Plan | None:
        """Drafts for a decode batch (chains or trees), or None for a plain step."""
        self._strategy = PLAIN
        if batch.is_prefill:
            return None
        reqs = batch.forward
        free = self._free_first(reqs)
        idle = self._idle(free)
        self._strategy = strategy = self.policy.choose(len(reqs), idle, self._upfront(reqs))
        if strategy.is_tree:
            proposer = self.proposers[strategy.proposer]
            assert isinstance(proposer, TreeProposer)  # config allows trees for these only
            budgets = [self._room(r, strategy.budget) for r in reqs]
            trees = proposer.propose_tree(reqs, strategy.depth, strategy.topk, budgets)
            return Plan(trees, chain=False) if any(t.size for t in trees) else None
        ks = [self._room(r, strategy.depth) for r in reqs]
        name = strategy.proposer
        if free is not None and name in (self._free, COMBINED):  # a prefix of what it drafted
            drafts = [_cut(d, k, strategy.min_prob) for d, k in zip(free, ks, strict=True)]
            if name == COMBINED:  # the drafter where the free proposer has nothing
                rest = [0 if d else k for d, k in zip(drafts, ks, strict=True)]
                drafted = self.proposers["drafter"].propose(reqs, rest)
                drafts = [d or e for d, e in zip(drafts, drafted, strict=True)]
        else:
            drafts = self.proposers[name].propose(reqs, ks)
        return Plan([DraftTree.chain(d) for d in drafts], chain=True) if any(drafts) else None

    def _free_first(self, reqs: list[Request]) -> list[Draft] | None:
        """Under ``auto``, the drafts of the model-free proposer (suffix or n-gram) at its
        deepest chain arm, asked before the policy chooses (speculative/policy.py: without
        drafts its arms are no candidates), with each draft's estimated acceptance (n-gram
        drafts: 1)."""
        depth = self._free_depth
        if not depth or len(reqs) > self.policy.max_batch:
            return None
        proposer = self.proposers[self._free]
        ks = [self._room(r, depth) for r in reqs]
        if isinstance(proposer, SuffixDrafts):
            return proposer.propose_scored(reqs, ks)
        return [Draft(d, list(range(len(d))), [1.0] * len(d)) for d in proposer.propose(reqs, ks)]

    def _upfront(self, reqs: list[Request]) -> dict[str, float]:
        """Seconds the drafter's arms would spend catching up before drafting this step."""
        p = self.proposers.get("drafter")
        if (not isinstance(p, DrafterProposer) or len(self.policy.arms) < 2
                or len(reqs) > self.policy.max_batch):
            return {}
        seconds = p.upfront_seconds(reqs)
        return {"drafter": seconds, COMBINED: seconds}

    def _idle(self, free: list[Draft] | None) -> tuple[str, ...]:
        """Proposers whose arms would run a plain step: the free one without any draft (and
        the combination, which is then the drafter alone)."""
        if free is None or any(d.tokens for d in free):
            return ()
        return (self._free, COMBINED)

    def _room(self, req: Request, n: int) -> int:
        """Draft tokens worth verifying: the step also commits one more token, and the
        drafts' KV must fit the row."""
        left = req.params.max_new_tokens - len(req.output_ids) - 1
        return max(0, min(n, left, self.max_len - req.num_tokens))

    def verify(
        self, plan: Plan, reqs: list[Request], runner: ModelRunner, shared: torch.Generator
    ) -> tuple[RunOutput, Emitted]:
        """One target forward over every request's [last token + drafts]; what each commits."""
        generators = [r.generator for r in reqs]
        if plan.chain:
            drafts = [list(t.tokens) for t in plan.trees]
            run = runner.verify(reqs, drafts)
            result = verify_chain(_chain_drafts(run, drafts, reqs), generators, shared)
            paths = None
        else:
            run = runner.verify_tree(reqs, plan.trees)
            params = [r.params for r in reqs]
            result, paths = verify_tree(run.logits, plan.trees, params, generators, shared)
            for req, path in zip(reqs, paths, strict=True):
                runner.keep_path(req, req.num_tokens - 1, path)
        emitted = Emitted(
            result.token_ids,
            result.logprobs,
            result.top_logprobs,
            drafted=[t.size for t in plan.trees],
            accepted=result.num_accepted,
            path=paths,
            drafter_version=self.drafter_version if self._uses_drafter else None,
        )
        return run, emitted

    @property
    def _uses_drafter(self) -> bool:
        return self._strategy.proposer in ("drafter", COMBINED)

    @property
    def drafter(self) -> DrafterModel | None:
        p = self.proposers.get("drafter")
        return p.drafter if isinstance(p, DrafterProposer) else None

    @property
    def drafter_version(self) -> int | None:
        d = self.drafter
        return None if d is None else d.spec.version

    def swap_drafter(self, new: DrafterModel) -> None:
        """Serve ``new`` from the next step on (call between steps).

        Its features must be the ones the engine computes (same ``feature_layers``). In-flight
        requests keep their drafter KV (written by the old weights): drafts stay proposals,
        so output is unaffected, and their next catch-up runs on the new weights. The
        policy forgets what it measured for drafter strategies (they must be re-measured).
        """
        p = self.proposers.get("drafter")
        if not isinstance(p, DrafterProposer):
            raise ValueError("drafter: this server was started without a drafter")
        if new.spec.feature_layers != self.feature_layers:
            raise ValueError(
                f"drafter: feature_layers {list(new.spec.feature_layers)} differ from the "
                f"serving drafter's {list(self.feature_layers)}"
            )
        p.drafter = new
        self.policy.forget("drafter")
        self.policy.forget(COMBINED)

    @property
    def needs_features(self) -> bool:
        return any(p.needs_features for p in self.proposers.values())

    def observe(self, committed: Committed) -> None:
        """Give drafters the features of each sampler's newly committed positions."""
        takers = [p for p in self.proposers.values() if p.needs_features]
        for req, feats in committed:
            for p in takers:
                p.observe(req, feats)

    def end_step(
        self, batch: ScheduledBatch, outputs: Sequence[StepOutput], seconds: float
    ) -> None:
        """Release finished requests; reward a decode step's strategy with its tokens/s."""
        self.release([r for r in batch.samplers if r.finished])
        if not batch.is_prefill:
            tokens = sum(len(o.token_ids) for o in outputs)
            self.policy.update(len(batch.forward), self._strategy, tokens, seconds)

    def release(self, reqs: Sequence[Request]) -> None:
        for req in reqs:
            for p in self.proposers.values():
                p.release(req)

    def move_row(self, src: int, dst: int, length: int) -> None:
        for p in self.proposers.values():
            p.move_row(src, dst, length)

    def weights_changed(self) -> None:
        for p in self.proposers.values():
            p.weights_changed()


def build_spec_decoder(
    config: SpecConfig, target: LlamaModel, rows: int, max_len: int, seed: int = 0
) -> SpecDecoder:
    """The proposers and policy ``config`` names, ready for a target (loads and checks a
    drafter). ``auto``: a bandit over plain decoding and each proposer at several depths."""
    proposers: dict[str, Proposer] = {PLAIN.proposer: NoProposer()}  # the baseline, always
    feature_layers: tuple[int, ...] = ()
    kind, auto = config.proposer, config.method == "auto"
    if kind == "ngram":
        proposers["ngram"] = NgramDrafts(NgramConfig(config.ngram_min_n, config.ngram_max_n))
    if kind == "suffix" or (auto and kind != "none"):
        proposers["suffix"] = SuffixDrafts(SuffixConfig(min_prob=config.suffix_min_prob))
    if kind == "drafter":
        drafter = load_drafter(str(config.drafter), target)
        proposers["drafter"] = DrafterProposer(
            drafter, rows, max_len, config.min_draft_confidence
        )
        feature_layers = drafter.spec.feature_layers
    names = [p for p in proposers if p != PLAIN.proposer]
    if auto:
        arms = [PLAIN, *(Strategy("suffix", d, min_prob=p) for d, p in config.suffix_chains)]
        arms += [Strategy("suffix", d, k, n) for d, k, n in config.suffix_trees]
        if "drafter" in proposers:
            arms += [Strategy(p, d) for p in ("drafter", COMBINED) for d in config.auto_depths]
            arms += [Strategy("drafter", d, k, n) for d, k, n in config.auto_trees]
    elif config.tree_topk > 1:  # one tree shape below max_batch
        arms = [Strategy(kind, config.num_draft_tokens, config.tree_topk, config.budget)]
    else:  # one proposer at one depth below max_batch (or plain decoding throughout)
        arms = [Strategy(p, config.num_draft_tokens) for p in names]
    policy = StrategyBandit(arms, config.max_batch, seed=seed)
    return SpecDecoder(config, proposers, policy, max_len, feature_layers)
