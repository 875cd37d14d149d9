"""TRL 1.16's own ``VLLMClient`` (``trl.generation.vllm_client``) against a running server:
``get_world_size``, ``generate`` with token-id prompts and logprobs (as ``/generate``
answers), ``get_sequence_logprobs`` (prompt logprobs: teacher forcing's, with the top ones),
``chat`` with token ids, ``reset_prefix_cache``, ``get_server_info``. The client runs in a
process of its own (``tests/trl_driver.py``). Its weight path (``init_communicator``, vLLM's
NCCL weight-transfer engine on CUDA) is not served, and the client says so before anything
else; ``tests/test_vllm_dialect.py`` tests the weight routes a trainer uses here.

Needs trl (``bash scripts/install.sh --trl``) and vLLM (which the client imports); skipped
without them, except where ``TLT_REQUIRE_TRL=1`` (CI) makes their absence a failure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from tests.harness import Served, need, serve

REPO = Path(__file__).resolve().parents[1]
need("trl", "bash scripts/install.sh --trl", "TLT_REQUIRE_TRL", load=False)
need("vllm", "bash scripts/install.sh --vllm", "TLT_REQUIRE_TRL", load=False)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    """As a TRL user starts vLLM for teacher scoring: ``--max-logprobs 100``."""
    s = serve(tiny_model_dir, max_logprobs=100)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trl_run(served, tmp_path_factory: pytest.TempPathFactory) -> dict:
    spec = {"prompts": [[5, 9, 23, 41], [11, 4, 4, 90, 2, 60]],
            "sequences": [[5, 9, 23, 41, 7, 7, 100, 3], [11, 4, 4, 90, 2]],
            "prompt_lengths": [4, 2],
            "messages": [{"role": "user", "content": "hi there"}]}
    d = tmp_path_factory.mktemp("trl")
    (d / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([sys.executable, "-m", "tests.trl_driver", served.base_url,
                          str(d / "spec.json"), str(d / "out.json")], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return {"spec": spec, **json.loads((d / "out.json").read_text())}


def test_world_size_and_generation_as_the_server_answers(trl_run, http) -> None:
    assert trl_run["world_size"] == 1
    got, spec = trl_run["generate"], trl_run["spec"]
    assert got["prompt_ids"] == spec["prompts"]
    for i, prompt in enumerate(spec["prompts"]):
        ref = http.post("/generate", json={
            "input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        for sample in (2 * i, 2 * i + 1):  # n = 2, greedy: the same
            assert got["completion_ids"][sample] == ref["output_ids"]
            best = [pos[0] for pos in got["logprobs"][sample]]  # sorted, the greedy token first
            assert best == pytest.approx(
                [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-4)
            assert [ids[:2] for ids in got["logprob_token_ids"][sample]] == [
                [t for _, t, _ in top] for top in ref["meta_info"]["output_top_logprobs"]]


def test_sequence_logprobs_are_teacher_forcings(trl_run, tiny_model_dir: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    scored, spec = trl_run["scored"], trl_run["spec"]
    for i, (seq, start) in enumerate(zip(spec["sequences"], spec["prompt_lengths"],
                                         strict=True)):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0, :-1].float(), dim=-1)
        actual = [pos[0] for pos in scored["actual_logprobs"][i]]
        assert actual == pytest.approx([float(ref[p - 1, seq[p]]) for p in range(start, len(seq))],
                                       abs=1e-4)
        assert scored["logprob_token_ids"][i] == [ref[p - 1].topk(3).indices.tolist()
                                                  for p in range(start, len(seq))]
        wide = trl_run["scored_default"]  # TRL's default asks the top 100 of every position
        assert [len(ids) for ids in wide["logprob_token_ids"][i]] == [100] * (len(seq) - start)
        assert [ids[:3] for ids in wide["logprob_token_ids"][i]] == scored["logprob_token_ids"][i]
        assert all(math.isfinite(lp) for pos in wide["logprobs"][i] for lp in pos)  # no padding


def test_chat_returns_token_ids_as_the_server_renders(trl_run, http) -> None:
    chat = trl_run["chat"]
    ref = http.post("/v1/chat/completions", json={
        "messages": trl_run["spec"]["messages"], "max_tokens": 4, "temperature": 0,
        "return_token_ids": True}).json()
    assert chat["prompt_ids"] == [ref["prompt_token_ids"]]
    assert chat["completion_ids"] == [ref["choices"][0]["token_ids"]]


def test_server_info_as_trl_reads_it_and_its_weight_path_refused_by_name(trl_run) -> None:
    """GRPO reads the logprobs mode (after temperature, as its importance sampling needs);
    ``init_communicator`` stops at once, naming the weight-transfer engine it lacks, rather
    than waiting on a rendezvous the server never joins."""
    assert trl_run["logprobs_mode"] == "processed_logprobs"
    assert "no weight-transfer engine" in trl_run["init_communicator"]
