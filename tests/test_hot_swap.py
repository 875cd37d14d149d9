"""Drafter hot-swap inside the engine: swaps between steps never change greedy output, every
result lists the drafter versions it used, bad checkpoints are refused with the old drafter
still serving, and a target update re-slices a drafter's draft head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import PROMPTS, make_llm
from tests.tiny import make_tiny_drafter
from tlt_serve import SamplingParams
from tlt_serve.backends.native.updates import EngineUpdates
from tlt_serve.config import SpecConfig
from tlt_serve.engine.engine import Engine
from tlt_serve.engine.outputs import RequestResult

LENGTHS = (40, 7, 64, 23, 50)


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("swap")
    return {
        "a": make_tiny_drafter(tiny_model_dir, root / "a", seed=11),
        "b": make_tiny_drafter(tiny_model_dir, root / "b", seed=12),
        "fused": make_tiny_drafter(tiny_model_dir, root / "f", seed=13, feature_layers=(0, 1)),
        "sliced": make_tiny_drafter(tiny_model_dir, root / "s", seed=14, draft_vocab_size=64),
    }


def run(engine: Engine, swap_every: int = 0, paths: tuple[Path, ...] = ()) -> list[RequestResult]:
    """Greedy generation of PROMPTS, swapping drafters (versions 1, 2, ...) every few steps."""
    results = {}
    for i, (text, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
        ids = engine.tokenizer.encode(text)
        (rid,) = engine.add_request(f"r{i}", ids, params)
        results[rid] = RequestResult(rid, ids)
    steps = swaps = 0
    while engine.has_work():
        if swap_every and steps and steps % swap_every == 0:
            swaps += 1
            update = EngineUpdates(engine).swap_drafter(str(paths[swaps % len(paths)]), swaps)
            assert update.success and update.drafter_version == swaps, update.message
        for out in engine.step():
            results[out.rid].add(out)
        steps += 1
    return list(results.values())


def test_swaps_between_steps_keep_greedy_output_exact(
    tiny_model_dir: Path, pair: dict[str, Path]
) -> None:
    plain = run(make_llm(tiny_model_dir).engine)
    spec = SpecConfig(
        method="drafter", min_draft_confidence=0.0, drafter=str(pair["a"]), num_draft_tokens=3,
    )
    engine = make_llm(tiny_model_dir, spec).engine
    swapped = run(engine, swap_every=2, paths=(pair["a"], pair["b"]))
    for p, s in zip(plain, swapped, strict=True):
        assert s.token_ids == p.token_ids
        torch.testing.assert_close(s.logprobs, p.logprobs, atol=1e-4, rtol=0)
    longest = swapped[2]
    assert len(longest.spec.drafter_versions) > 3  # it saw several drafters
    assert list(longest.spec.drafter_versions) == sorted(longest.spec.drafter_versions)
    assert engine.spec.drafter_version == longest.spec.drafter_versions[-1]
    stats = engine.stats
    assert 0 < stats.spec.steps <= 256  # all inside the recent window: recent = overall
    assert stats.recent_accept_length == pytest.approx(stats.spec.accepted / stats.spec.verifies)


def test_bad_swaps_are_refused_and_the_old_drafter_serves_on(
    tiny_model_dir: Path, pair: dict[str, Path], tmp_path: Path
) -> None:
    spec = SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(pair["a"]))
    engine = make_llm(tiny_model_dir, spec).engine
    updates = EngineUpdates(engine)
    assert updates.swap_drafter(str(pair["b"]), version=5).success
    before = engine.spec.drafter
    for path, words in [
        (tmp_path / "missing", "not a directory"),
        (pair["fused"], "feature_layers"),
        (tiny_model_dir, "tlt_drafter"),  # a target, not a drafter
    ]:
        result = updates.swap_drafter(str(path))
        assert not result.success and words in result.message, result.message
        assert result.drafter_version == 5 and engine.spec.drafter is before
    plain_engine = make_llm(tiny_model_dir).engine
    refused = EngineUpdates(plain_engine).swap_drafter(str(pair["a"]))
    assert not refused.success and "without a drafter" in refused.message
    out = run(engine)  # still serving, and only version 5 drafts
    assert all(r.spec.drafter_versions == (5,) for r in out)


def test_target_update_reslices_the_draft_head(
    tiny_model_dir: Path, pair: dict[str, Path]
) -> None:
    spec = SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(pair["sliced"]))
    engine = make_llm(tiny_model_dir, spec).engine
    drafter = engine.spec.drafter
    assert drafter is not None and drafter.head is not None
    name = "model.embed_tokens.weight" if engine.model.cfg.tie_word_embeddings else "lm_head.weight"
    new = engine.model.lm_head.weight.detach().clone() * 1.5
    assert EngineUpdates(engine).load([(name, new)], "1").weight_version == "1"
    torch.testing.assert_close(drafter.head.weight, new[drafter.draft_vocab])


def test_the_draft_head_multiplies_as_the_target_head(
    tiny_model_dir: Path, pair: dict[str, Path]
) -> None:
    """The sliced draft head takes the target head's product and row limit (in bf16 the own
    kernel's, up to ``matvec_rows`` rows), not the defaults of a new Linear."""
    spec = SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(pair["sliced"]))
    engine = make_llm(tiny_model_dir, spec, dtype="bfloat16").engine
    drafter, head = engine.spec.drafter, engine.model.lm_head
    assert drafter is not None and drafter.head is not None
    assert drafter.head.matvec is head.matvec
    assert drafter.head.matvec_rows == head.matvec_rows
    if engine.model.kernels is not None:
        assert head.matvec is not None and head.matvec_rows == engine.model.kernels.matvec_rows
