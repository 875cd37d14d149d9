"""Speculative decoding on the real default model (SmolLM2-135M), fp32: identical greedy tokens
with speculation on (n-gram chains, drafter chains, drafter trees, the adaptive policy) and
off, alone and at batch 8, and when the batch-size switch turns speculation on and off partway
through a generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.staged import assert_switched_on_off_on, run_staged
from tests.test_real_model import PROMPTS as REAL_PROMPTS
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tlt_serve.speculative.checkpoint import save_drafter
from tlt_serve.speculative.drafter import DrafterSpec, new_drafter
from trainer.data import build_draft_vocab, make_samples, target_features
from trainer.target import head_target
from trainer.train import TrainConfig, train

pytestmark = pytest.mark.real_model

PROMPTS = [
    *REAL_PROMPTS,
    "List the first ten prime numbers.",
    "Explain what a hash table is in one paragraph.",
    "Write a haiku about the sea.",
]
LENGTHS = [40, 16, 36, 28, 40, 10, 32, 20]  # different, so the batch shrinks as it runs


def make(spec: SpecConfig | None = None) -> LLM:
    cfg = EngineConfig(
        model=ModelConfig(model="smollm2-135m", dtype="float32", max_model_len=512),
        cache=CacheConfig(max_num_seqs=8),
        spec=spec or SpecConfig(),
    )
    return LLM(config=cfg)


def params() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS]


def chat(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain() -> tuple[LLM, list[list[int]]]:
    llm = make()
    outs = llm.generate(chat(llm), params())
    return llm, [o.samples[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def drafter_dir(plain, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drafter fitted in seconds to the target's own answers to these prompts.

    Exactness does not depend on draft quality, but only accepted drafts exercise what a
    rejected one never reaches: keeping the accepted path's KV, the bonus token, advancing
    the drafter along the path. An untrained drafter accepts almost nothing here."""
    llm, ref = plain
    prompts = chat(llm)
    model = llm.engine.model
    samples = make_samples(
        prompts,
        ref,
        target_features(model, [p + r for p, r in zip(prompts, ref, strict=True)], 4096),
    )
    stub = head_target(model, max(len(p) + len(r) for p, r in zip(prompts, ref, strict=True)) + 16)
    spec = DrafterSpec(draft_vocab_size=2048)
    d = new_drafter(stub, spec, seed=0)
    with torch.no_grad():
        d.draft_vocab.copy_(build_draft_vocab(ref, prompts, 2048, model.cfg.vocab_size))
    d.refresh_head()
    cfg = TrainConfig(
        steps=150, batch_tokens=512, row_len=128, lr=3e-3, warmup_steps=5, eval_every=0
    )
    train(d, samples, [], cfg, seed=0)
    hf = json.loads((llm.engine.model_path / "config.json").read_text())
    return save_drafter(d, tmp_path_factory.mktemp("drafter") / "d", hf, spec)


def spec_for(proposer: str, drafter: Path, max_batch: int) -> SpecConfig:
    method = {"ngram": "ngram", "auto": "auto"}.get(proposer, "drafter")
    return SpecConfig(
        method=method,
        drafter=None if proposer == "ngram" else str(drafter),
        min_draft_confidence=0.0,
        max_batch=max_batch,
        tree_topk=3 if proposer == "tree" else 1,
    )


@pytest.mark.parametrize("proposer", ["ngram", "drafter", "tree"])
def test_greedy_speculation_is_exact_alone_batched_and_switching(
    plain, drafter_dir, proposer
) -> None:
    base, ref = plain
    prompts = chat(base)
    on = make(spec_for(proposer, drafter_dir, max_batch=8))
    batched = on.generate(prompts, params())
    assert [o.samples[0].token_ids for o in batched] == ref
    assert on.engine.stats.spec.accepted > 0
    for i in range(5):  # alone (batch 1)
        got = on.generate([prompts[i]], [params()[i]])[0].samples[0]
        assert got.token_ids == ref[i], PROMPTS[i]
    # Switch at 3 running sequences: plain steps first, speculation once the tail begins.
    switching = make(spec_for(proposer, drafter_dir, max_batch=3))
    outs = switching.generate(prompts, params())
    assert [o.samples[0].token_ids for o in outs] == ref
    stats = switching.engine.stats
    assert 0 < stats.spec.steps < stats.decode_steps
    assert stats.spec.accepted > 0


@pytest.mark.parametrize("proposer", ["drafter", "tree", "auto"])
def test_speculation_switches_off_when_a_crowd_joins_and_back_on_in_its_tail(
    plain, drafter_dir, proposer
) -> None:
    """One request speculates alone, seven join (plain steps above max_batch 2), speculation
    resumes as they finish: the same tokens as plain decoding, and no target prefill beyond
    plain decoding's (the drafter catches up from the features the engine kept)."""
    base, ref = plain
    prompts = chat(base)
    plain_eng = make().engine
    staged_plain = run_staged(plain_eng, prompts, params(), join_at=4)
    assert staged_plain.ids(len(prompts)) == ref
    eng = make(spec_for(proposer, drafter_dir, max_batch=2)).engine
    run = run_staged(eng, prompts, params(), join_at=4)
    assert run.ids(len(prompts)) == ref
    assert_switched_on_off_on(run, max_batch=2)
    assert eng.stats.prefill_steps == plain_eng.stats.prefill_steps
    assert eng.stats.spec.accepted > 0
