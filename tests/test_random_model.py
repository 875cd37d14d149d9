"""benchmarks.random_model: a random checkpoint at a given shape that the engine serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.random_model import main
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import EngineConfig, ModelConfig

pytestmark = pytest.mark.real_model  # the default model's tokenizer


def test_a_random_checkpoint_has_the_shape_asked_and_serves(tmp_path: Path) -> None:
    out = main([str(tmp_path / "m"), "--hidden", "64", "--intermediate", "96", "--layers", "2",
                "--heads", "4", "--kv-heads", "2"])
    llm = LLM(config=EngineConfig(model=ModelConfig(model=str(out), dtype="float32",
                                                    max_model_len=64)))
    model = llm.engine.model
    assert (model.cfg.hidden_size, model.cfg.intermediate_size, model.cfg.num_layers) == (64, 96, 2)
    assert model.cfg.vocab_size == len(llm.tokenizer.hf)  # the default model's tokenizer
    got = llm.generate("Hello", SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(got[0].samples[0].token_ids) == 3
