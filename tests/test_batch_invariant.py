"""Batch-invariant kernels (``--batch-invariant``): in bf16 on a CPU every product and attention
runs through the own kernels whatever a step's rows, so a token's logits depend on the tokens
before it only. A sequence's tokens and logprobs are then the same alone or in any batch, with
speculation or the prefix cache, and scoring it returns the logprobs it was generated with, bit
for bit (without the mode, prefills and large steps take torch's products, which round
otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.harness import PROMPTS, own_kernels
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from tlt_serve.flags import parse as parse_serve_flags
from tlt_serve.kernels import EVERY_ROW


def invariant_llm(path: Path, spec: SpecConfig | None = None, prefix_cache: bool = False) -> LLM:
    own_kernels()  # a skip without them (a failure where they are required)
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(path), dtype="bfloat16", max_model_len=512,
                          batch_invariant=True),
        cache=CacheConfig(max_num_seqs=8, prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(max_prefill_tokens=512),
        spec=spec or SpecConfig()))


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return invariant_llm(tiny_model_dir)


def prompts(llm: LLM) -> list[list[int]]:
    """Eight prompts of 4-120 tokens: their prefill is one step of more rows than a decode
    step's own product takes by default."""
    return [llm.tokenizer.encode(PROMPTS[i % 5] * (1 + i % 3)) for i in range(8)]


PARAMS = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True),
          SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True,
                         logprobs=True)]


def outputs(results) -> list[tuple[list[int], list[float]]]:
    return [(r.samples[0].token_ids, r.samples[0].logprobs) for r in results]


def test_every_row_goes_to_the_own_kernels(llm: LLM) -> None:
    model = llm.engine.model
    assert model.kernels is not None
    assert model.lm_head.matvec_rows == EVERY_ROW and model.lm_head.weight_f32 is None
    assert all(layer.kernel is not None and layer.kernel_rows == EVERY_ROW
               and layer.self_attn.kernel_queries == EVERY_ROW
               and layer.self_attn.block_queries == EVERY_ROW for layer in model.layers)
    # no prefill attends by blocks (their weights rounded to bf16: not a decode step's bits)
    assert model.kernels.block_queries == EVERY_ROW
    assert model.stack is None or model.stack.block_queries == EVERY_ROW


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_a_sequence_alone_or_in_a_batch_gets_the_same_bits(llm: LLM, params) -> None:
    ids = prompts(llm)
    together = outputs(llm.generate(ids, params))
    alone = [outputs(llm.generate([p], params))[0] for p in ids]
    assert together == alone


def test_scoring_returns_the_logprobs_a_sequence_was_generated_with(llm: LLM) -> None:
    ids = prompts(llm)
    generated = llm.generate(ids, PARAMS[1])
    sequences = [p + r.samples[0].token_ids for p, r in zip(ids, generated, strict=True)]
    scored = llm.generate(sequences, [SamplingParams(max_new_tokens=0, prompt_logprobs=0,
                                                     prompt_logprobs_start=len(p)) for p in ids])
    for res, gen in zip(scored, generated, strict=True):
        got = res.samples[0].prompt_logprobs
        assert got is not None and got.logprobs == gen.samples[0].logprobs


@pytest.mark.parametrize("tree", [1, 3], ids=["chains", "trees"])
def test_speculation_keeps_the_bits(tiny_model_dir: Path, tiny_drafter_dir: Path, llm: LLM,
                                    tree: int) -> None:
    """Verify steps of 8 x (1 + up to 7) rows (chains, or trees whose nodes see their
    ancestors) against plain steps of 8 rows: a drafter that always drafts."""
    spec = invariant_llm(tiny_model_dir, SpecConfig(
        method="drafter", drafter=str(tiny_drafter_dir), min_draft_confidence=0.0,
        num_draft_tokens=7, tree_topk=tree, verify_budget=7 if tree > 1 else 0, max_batch=8))
    ids = prompts(llm)
    for params in PARAMS:
        assert outputs(spec.generate(ids, params)) == outputs(llm.generate(ids, params))
    assert spec.engine.stats.spec.verifies > 0


def test_a_cached_prefix_keeps_the_bits(tiny_model_dir: Path, llm: LLM) -> None:
    cached = invariant_llm(tiny_model_dir, prefix_cache=True)
    ids = prompts(llm)
    first = outputs(cached.generate(ids, PARAMS[1]))
    again = cached.generate([p + [5, 6] for p in ids], PARAMS[1])  # each prompt's KV reused
    assert all(r.samples[0].cached_tokens >= len(p) - 1 for p, r in zip(ids, again, strict=True))
    assert first == outputs(llm.generate(ids, PARAMS[1]))
    assert outputs(again) == outputs(llm.generate([p + [5, 6] for p in ids], PARAMS[1]))


@pytest.mark.parametrize(("model_kw", "backend", "spec"), [
    ({"dtype": "float32"}, "native", SpecConfig()),
    ({"device": "cuda"}, "native", SpecConfig()),
    ({}, "vllm", SpecConfig()),
    ({}, "native", SpecConfig(method="suffix", tree_topk=2, num_draft_tokens=8,
                              verify_budget=63)),
    ({}, "native", SpecConfig(method="auto", suffix_trees=((8, 2, 64),))),
])
def test_refused_where_it_cannot_hold(model_kw, backend: str, spec: SpecConfig) -> None:
    config = EngineConfig(model=ModelConfig(batch_invariant=True, **model_kw), backend=backend,
                          spec=spec)
    with pytest.raises(ConfigError, match="^batch_invariant:"):
        config.validate()


def test_torchs_silu_is_row_invariant() -> None:
    """The layer kernel's one torch op, the MLP's SiLU, splits a large step's activations
    among threads: a row still gets the bits it gets alone, on 1-16 threads, for rows of a
    whole number of vectors or not, read as the kernel reads them (the gate half of each
    gate-up row: a strided view)."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    try:
        for width in (1536, 1000, 8960):
            for n in (1, 2, 3, 5, 8, 16):
                torch.set_num_threads(n)
                for rows in (7, 64, 129):
                    gate_up = (torch.randn(rows, 2 * width, generator=g) * 3).bfloat16()
                    x = gate_up.narrow(1, 0, width)  # [rows, width], rows 2 * width apart
                    alone = torch.cat([F.silu(x[i : i + 1]) for i in range(rows)])
                    assert torch.equal(F.silu(x), alone), (width, n, rows)
    finally:
        torch.set_num_threads(threads)


def test_the_flag(capsys) -> None:
    assert parse_serve_flags(["--batch-invariant"]).engine.model.batch_invariant
    with pytest.raises(SystemExit) as exc:
        parse_serve_flags(["--batch-invariant", "--dtype", "float32"])
    assert exc.value.code == 2 and "--batch-invariant" in capsys.readouterr().err
