"""Tree verification alone: greedy path walk, recursive rejection sampling is lossless (and a
biased variant is caught), chains agree with the chain verifier, logprobs are the target's."""

from __future__ import annotations

import pytest
import torch

from tests.reference import (
    LOGITS0,
    LOGITS1,
    LOGITS2,
    SETTINGS,
    V,
    chi_square,
    critical,
    expected_joint,
)
from tlt_serve.engine.draft_tree import DraftTree
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.speculative import tree as tree_mod
from tlt_serve.speculative.tree import verify_tree
from tlt_serve.speculative.verify import ChainDrafts, verify_chain

GREEDY = SamplingParams(temperature=0.0)
# Root children 1, 3, 0 (distinct), each with one child: 7 nodes, depth 2.
TREE = DraftTree(tokens=(1, 3, 0, 2, 4, 5), parents=(0, 0, 0, 1, 2, 3))


def tree_logits(tree: DraftTree) -> torch.Tensor:
    """[N+1, V]: the root scores after the context, a depth-1 node with token x scores
    LOGITS1[x], deeper nodes LOGITS2 (the third token is not examined)."""
    rows = [LOGITS0]
    depths = tree.depths()
    for i, tok in enumerate(tree.tokens, start=1):
        rows.append(LOGITS1[tok] if depths[i] == 1 else LOGITS2)
    return torch.stack(rows)


def _retrying_walk(tree, choose):  # type: ignore[no-untyped-def]
    """A bug to catch: a draw that no child drafted gets a second draw (favours drafts)."""
    kids = tree.children()
    node, path, emitted = 0, [0], []
    while True:
        want = choose(node)
        nxt = next((c for c in kids[node] if tree.tokens[c - 1] == want), None)
        if nxt is None and kids[node]:
            want = choose(node)
            nxt = next((c for c in kids[node] if tree.tokens[c - 1] == want), None)
        emitted.append(want)
        if nxt is None:
            return path, emitted
        node = nxt
        path.append(node)


def sample_two(params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """Counts [V, V] of the first two emitted tokens over n rows verifying TREE."""
    gen = torch.Generator().manual_seed(seed)
    logits = tree_logits(TREE).expand(n, -1, -1)  # [n, N+1, V]
    result, _ = verify_tree(logits, [TREE] * n, [params] * n, shared=gen)
    e0 = torch.tensor([t[0] for t in result.token_ids])
    e1 = torch.tensor([t[1] if len(t) > 1 else -1 for t in result.token_ids])
    again = (e1 < 0).nonzero().squeeze(1)
    if len(again):  # a second step with no drafts, after the emitted token
        root_only = DraftTree((), ())
        step2, _ = verify_tree(
            LOGITS1[e0[again]].unsqueeze(1),
            [root_only] * len(again),
            [params] * len(again),
            shared=gen,
        )
        e1[again] = torch.tensor([t[0] for t in step2.token_ids])
    return torch.bincount(e0 * V + e1, minlength=V * V).view(V, V)


@pytest.mark.parametrize("setting", SETTINGS)
def test_sampled_tree_walk_is_lossless(setting: str) -> None:
    params = SETTINGS[setting]
    counts = sample_two(params, 20000)
    stat, df = chi_square(counts, expected_joint(params))
    assert stat < critical(df), (setting, stat, df)


def test_a_biased_tree_walk_is_caught(monkeypatch) -> None:
    monkeypatch.setattr(tree_mod, "_walk", _retrying_walk)
    params = SETTINGS["T1"]
    stat, df = chi_square(sample_two(params, 20000), expected_joint(params))
    assert stat > critical(df)


def test_greedy_follows_the_argmax_path_through_any_branch() -> None:
    logits = tree_logits(TREE)
    want0 = int(LOGITS0.argmax())  # 0: the root's third child
    assert want0 == 0
    want1 = int(LOGITS1[0].argmax())
    result, paths = verify_tree(logits.unsqueeze(0), [TREE], [GREEDY])
    node1 = 3  # the child with token 0
    if want1 == 5:  # its own child matches too: accepted, then the bonus from LOGITS2
        assert paths[0] == [0, node1, 6]
        assert result.token_ids[0] == [0, 5, int(LOGITS2.argmax())]
    else:
        assert paths[0] == [0, node1]
        assert result.token_ids[0] == [0, want1]
    assert result.num_accepted[0] == len(paths[0]) - 1
    expected_lp = [
        float(torch.log_softmax(logits[n], -1)[t])
        for n, t in zip(paths[0], result.token_ids[0], strict=True)
    ]
    assert result.logprobs[0] == pytest.approx(expected_lp, abs=1e-6)


def test_a_chain_tree_agrees_with_the_chain_verifier() -> None:
    gen = torch.Generator().manual_seed(5)
    B, K = 64, 4
    logits = torch.randn(B, K + 1, 7, generator=gen) * 3
    drafts = logits[:, :K].argmax(-1)  # [B, K] greedy-accepted chains ...
    drafts[::3, 2] = (drafts[::3, 2] + 1) % 7  # ... with some mismatches
    chain = verify_chain(ChainDrafts(logits, drafts, torch.full((B,), K), (GREEDY,) * B))
    trees = [DraftTree.chain(d) for d in drafts.tolist()]
    result, paths = verify_tree(logits, trees, [GREEDY] * B)
    assert result.token_ids == chain.token_ids
    assert result.num_accepted == chain.num_accepted
    for got, want in zip(result.logprobs, chain.logprobs, strict=True):
        assert got == pytest.approx(want)
    assert all(p == list(range(len(p))) for p in paths)


def test_tree_structure_helpers() -> None:
    assert TREE.depths() == [0, 1, 1, 1, 2, 2, 2]
    assert TREE.children()[0] == [1, 2, 3]
    mask = TREE.ancestor_mask()
    assert mask[4].tolist() == [True, True, False, False, True, False, False]
    with pytest.raises(ValueError, match="parent"):
        DraftTree((1, 2), (0, 2))
