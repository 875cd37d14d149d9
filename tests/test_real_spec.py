"""Speculative decoding on the real default model (SmolLM2-135M), fp32: identical greedy tokens
with speculation on (n-gram chains, drafter chains, drafter trees) and off, alone and at batch 8,
and when the batch-size switch turns speculation on partway through a generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_real_model import PROMPTS as REAL_PROMPTS
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tlt_serve.spec.checkpoint import save_drafter
from tlt_serve.spec.drafter import DrafterSpec, new_drafter

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


@pytest.fixture(scope="module")
def plain() -> tuple[LLM, list[list[int]]]:
    llm = make()
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = llm.generate(prompts, params())
    return llm, [o.samples[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def drafter_dir(plain, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained drafter (exactness does not depend on draft quality)."""
    llm, _ = plain
    spec = DrafterSpec(draft_vocab_size=4096)
    d = new_drafter(llm.engine.model, spec, seed=0)
    with torch.no_grad():
        d.draft_vocab.copy_(torch.arange(4096))
    hf = json.loads((llm.engine.model_path / "config.json").read_text())
    return save_drafter(d, tmp_path_factory.mktemp("drafter") / "d", hf, spec)


@pytest.mark.parametrize("proposer", ["ngram", "drafter", "tree"])
def test_greedy_speculation_is_exact_alone_batched_and_switching(
    plain, drafter_dir, proposer
) -> None:
    base, ref = plain
    prompts = [
        base.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS
    ]
    method = "ngram" if proposer == "ngram" else "drafter"
    path = None if proposer == "ngram" else str(drafter_dir)
    topk = 3 if proposer == "tree" else 1
    on = make(SpecConfig(
        method=method, drafter=path, min_draft_confidence=0.0, max_batch=8, tree_topk=topk,
    ))
    batched = on.generate(prompts, params())
    assert [o.samples[0].token_ids for o in batched] == ref
    assert on.engine.stats.spec_steps > 0
    for i in range(5):  # alone (batch 1)
        got = on.generate([prompts[i]], [params()[i]])[0].samples[0]
        assert got.token_ids == ref[i], PROMPTS[i]
    # Switch at 3 running sequences: plain steps first, speculation once the tail begins.
    switching = make(SpecConfig(
        method=method, drafter=path, min_draft_confidence=0.0, max_batch=3, tree_topk=topk,
    ))
    outs = switching.generate(prompts, params())
    assert [o.samples[0].token_ids for o in outs] == ref
    stats = switching.engine.stats
    assert 0 < stats.spec_steps < stats.decode_steps
