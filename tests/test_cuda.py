"""The native engine on CUDA (``--device cuda``), on tiny random models in fp32: greedy output
with speculation on (n-gram, suffix drafts, a drafter, draft trees) equals plain decoding on
the GPU, alone and batched, with the same logprobs; a seeded request samples the same tokens
with speculation on as off, and the same as on the CPU (its uniforms come from CPU
generators); the sampler and the chain verifier give on CUDA logits what they give on the same
logits on the CPU.

Self-contained (no conftest, no server): ``scripts/gpu_check.sh`` runs it on a GPU machine
with ``--noconftest``. Skipped without a CUDA device unless ``TLT_REQUIRE_CUDA=1``;
``TLT_TEST_DEVICE=cpu`` runs the same code with the CPU in the GPU's place (the check's dry
run: it shows the tests themselves work, not anything about a GPU).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny import make_tiny_drafter, make_tiny_model
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig

DEVICE = os.environ.get("TLT_TEST_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    if os.environ.get("TLT_REQUIRE_CUDA") == "1":
        pytest.fail("no CUDA device; TLT_REQUIRE_CUDA=1 requires one", pytrace=False)
    pytest.skip("no CUDA device", allow_module_level=True)

PROMPTS = ["The quick brown fox", "def add(a, b):", "What is 12 + 7?", "Bonjour, ça va?",
           "Speculative decoding drafts tokens"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda")
    target = make_tiny_model(root / "llama")
    return {"target": target, "drafter": make_tiny_drafter(target, root / "drafter", seed=1)}


def llm(models: dict[str, Path], device: str, spec: SpecConfig | None = None,
        eager: bool = False, compile: bool = True, attention: str = "sdpa") -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(models["target"]), dtype="float32", max_model_len=256,
                          device=device, enforce_eager=eager, compile=compile,
                          attention_backend=attention),
        cache=CacheConfig(max_num_seqs=8),
        spec=spec or SpecConfig(),
    ))


def greedy() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
            for n in (40, 7, 64, 23, 50)]


def seeded() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, temperature=t, seed=100 + i, ignore_eos=True,
                           logprobs=True, top_p=0.9)
            for i, (n, t) in enumerate(zip((40, 7, 64, 23, 50), (0.3, 0.5, 1.0, 0.7, 0.3),
                                           strict=True))]


def specs(models: dict[str, Path]) -> dict[str, SpecConfig]:
    drafter = str(models["drafter"])
    return {
        "ngram": SpecConfig(method="ngram"),
        "suffix": SpecConfig(method="suffix", num_draft_tokens=8),
        "drafter": SpecConfig(method="drafter", drafter=drafter, min_draft_confidence=0.0),
        "tree": SpecConfig(method="drafter", drafter=drafter, tree_topk=3, verify_budget=7,
                           min_draft_confidence=0.0),
    }


@pytest.mark.parametrize("name", ["ngram", "suffix", "drafter", "tree"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_speculation_on_cuda_equals_plain_decoding(models, name, sampling) -> None:
    params = greedy() if sampling == "greedy" else seeded()
    plain = llm(models, DEVICE).generate(PROMPTS, params)
    spec = llm(models, DEVICE, specs(models)[name])
    batched = spec.generate(PROMPTS, params)
    alone = [spec.generate([p], [sp])[0] for p, sp in zip(PROMPTS, params, strict=True)]
    for ref, got_b, got_1 in zip(plain, batched, alone, strict=True):
        r, b, one = ref.samples[0], got_b.samples[0], got_1.samples[0]
        assert b.token_ids == r.token_ids == one.token_ids
        torch.testing.assert_close(b.logprobs, r.logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(one.logprobs, r.logprobs, atol=1e-4, rtol=0)
    assert spec.engine.stats.spec.steps > 0
    assert spec.engine.kv.storage.device.type == DEVICE


@pytest.mark.parametrize("name", ["plain", "drafter", "uncompiled", "triton"])
def test_cuda_graphs_decode_what_eager_steps_decode(models, name) -> None:
    """Decode and verify steps replayed from CUDA graphs (the default on a GPU: the layers
    compiled; ``uncompiled``: as written; ``triton``: compiled, attending through the own
    kernel; all three with drafter verify steps) against the same engine with
    ``enforce_eager``: the same greedy tokens, logprobs to fp32 GEMM tolerance (a padded
    batch may take other GEMM kernels), graphs captured and reused."""
    spec = specs(models)["drafter"] if name != "plain" else None
    eager = llm(models, DEVICE, spec, eager=True).generate(PROMPTS, greedy())
    graphed = llm(models, DEVICE, spec, compile=name != "uncompiled",
                  attention="triton" if name == "triton" else "sdpa")
    got = graphed.generate(PROMPTS, greedy())
    again = graphed.generate(PROMPTS, greedy())  # the graphs replayed, none captured anew
    for ref, out, out2 in zip(eager, got, again, strict=True):
        assert out.samples[0].token_ids == ref.samples[0].token_ids == out2.samples[0].token_ids
        torch.testing.assert_close(out.samples[0].logprobs, ref.samples[0].logprobs,
                                   atol=1e-4, rtol=0)
    graphs = graphed.engine.runner.graphs
    if DEVICE == "cuda":
        assert graphs is not None and graphs.steps
        assert all(step.graph is not None for step in graphs.steps.values())
        # compiled, or as asked not: no fallback from a failed compile
        assert (graphs.layer_fn is not None) == (name != "uncompiled")
        if name == "triton":
            assert graphs.layer_fn is not None and graphs.layer_fn.attention == "triton"
        if name != "plain":
            assert any(shape.queries > 1 for shape in graphs.steps)
    else:
        assert graphs is None  # CUDA graphs are CUDA's


def test_cuda_samples_what_the_cpu_samples(models) -> None:
    """Same weights, fp32, seeded: the first tokens agree with the CPU engine's and their
    logprobs to fp32 GEMM tolerance (later tokens may part where two logits all but tie)."""
    params = seeded()
    gpu = llm(models, DEVICE).generate(PROMPTS, params)
    cpu = llm(models, "cpu").generate(PROMPTS, params)
    for g, c in zip(gpu, cpu, strict=True):
        assert g.samples[0].token_ids[:4] == c.samples[0].token_ids[:4]
        torch.testing.assert_close(g.samples[0].logprobs[:4], c.samples[0].logprobs[:4],
                                   atol=1e-3, rtol=0)


def test_sampler_and_verifier_on_cuda_logits_match_the_cpu() -> None:
    from tlt_serve.engine.request import Request
    from tlt_serve.engine.sampler import Sampler
    from tlt_serve.speculative.verify import ChainDrafts, verify_chain

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 300, generator=g) * 3  # [B, K + 1, V]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.5,
                                                                         min_p=0.1)]
    reqs = [Request(f"r{i}", [1, 2, 3], p, None) for i, p in enumerate(params)]
    drafts = torch.randint(0, 300, (4, 4), generator=g)
    drafts[0] = logits[0, :4].argmax(dim=-1)  # a row whose greedy drafts are all accepted
    out = {}
    for device in ("cpu", DEVICE):
        sampled = Sampler(7).sample(logits[:, 0].to(device), reqs)
        chain = ChainDrafts(logits.to(device), drafts.to(device),
                            torch.full((4,), 4, device=device), tuple(params))
        verified = verify_chain(chain, shared=torch.Generator().manual_seed(3))
        out[device] = (sampled.token_ids, verified.num_accepted, verified.token_ids)
        lps = (sampled.logprobs, verified.logprobs)
        out[device + "_lp"] = lps
    assert out[DEVICE] == out["cpu"]
    assert out[DEVICE][1][0] == 4
    (s_gpu, v_gpu), (s_cpu, v_cpu) = out[DEVICE + "_lp"], out["cpu_lp"]
    torch.testing.assert_close(s_gpu, s_cpu, atol=1e-4, rtol=0)
    for row_gpu, row_cpu in zip(v_gpu, v_cpu, strict=True):  # ragged: accepted + 1 per row
        torch.testing.assert_close(row_gpu, row_cpu, atol=1e-4, rtol=0)


def test_the_drafter_trains_on_cuda_within_its_memory_budget(models) -> None:
    """The online trainer's micro-step (its batch moved to the GPU) under the budget
    ``--memory-gib`` sets: it trains within a generous one and is refused past a tiny one."""
    from tlt_serve.models.loader import build_model
    from tlt_serve.speculative.drafter import DrafterSpec, new_drafter
    from trainer.packing import PackedBatch
    from trainer.target import head_target
    from trainer.train import TrainConfig, make_optimizer, step_loss

    if DEVICE != "cuda":
        pytest.skip("a memory budget is the CUDA caching allocator's")
    device = torch.device("cuda", torch.cuda.current_device())  # the share is per index
    target = build_model(models["target"], torch.float32, 256, "cuda")
    drafter = new_drafter(head_target(target, 256), DrafterSpec()).train()
    H = target.cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    batch = PackedBatch(torch.randint(0, 300, (4, 64), generator=g),
                        torch.randn(4, 64, H, generator=g), torch.randn(4, 64, H, generator=g),
                        torch.zeros(4, 64, dtype=torch.long),
                        torch.arange(64).expand(4, 64).contiguous(),
                        torch.ones(4, 64, dtype=torch.bool), torch.ones(4, 64, dtype=torch.bool))
    cfg = TrainConfig()
    opt = make_optimizer(drafter, cfg, 1e-3)

    def micro_step() -> float:
        b = batch.to(device)
        loss, _, _ = step_loss(drafter, b, cfg, torch.zeros_like(b.features))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    total = torch.cuda.get_device_properties(device).total_memory
    # the share caps the whole process: earlier tests' engines (graph pools) still hold some
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(device)
    try:
        torch.cuda.set_per_process_memory_fraction((held + (1 << 30)) / total, device)
        torch.cuda.reset_peak_memory_stats(device)
        first = micro_step()
        losses = [micro_step() for _ in range(20)]
        assert losses[-1] < first  # it learns (random targets: the loss still falls)
        assert torch.cuda.max_memory_allocated(device) <= held + (1 << 30)
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved(device)
        torch.cuda.set_per_process_memory_fraction((held + (1 << 20)) / total, device)  # 1 MiB
        with pytest.raises(torch.OutOfMemoryError):
            bigger = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # 64 MiB
            del bigger
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


BORROWER = """
import sys, torch
from tlt_serve.engine.capture import decode_samples
samples = decode_samples(sys.stdin.buffer.read())
where = [s.features.device.type for s in samples]
assert where == [sys.argv[2]] * len(samples), where
torch.save({s.seq: s.features.cpu() for s in samples}, sys.argv[1])
"""


def test_captured_features_stay_on_the_device_and_go_by_reference(models, tmp_path) -> None:
    """Capture keeps the features on the engine's device (no copy to the host per step); a
    second process borrows them by reference (CUDA IPC) and gets, on its GPU, what the
    by-value feed sends; the trainer's batches are built there from them."""
    import subprocess
    import sys

    from tlt_serve.config import CaptureConfig
    from tlt_serve.engine.capture import encode_samples, encode_shared
    from tlt_serve.engine.handoff import Lent
    from trainer.data import Sample
    from trainer.packing import batches

    engine = LLM(config=EngineConfig(
        model=ModelConfig(model=str(models["target"]), dtype="float32", max_model_len=256,
                          device=DEVICE),
        cache=CacheConfig(max_num_seqs=8), capture=CaptureConfig(enabled=True)))
    engine.generate(PROMPTS, greedy())
    samples = engine.engine.capture.take(0, 1 << 30)
    assert len(samples) == len(PROMPTS)
    assert all(s.features.device.type == DEVICE for s in samples)
    out, lent = tmp_path / "got.pt", Lent()  # keeps the loan alive until it is opened
    run = subprocess.run([sys.executable, "-c", BORROWER, str(out), DEVICE],
                         input=encode_shared(samples, lent), capture_output=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    got = torch.load(out)
    from tlt_serve.engine.capture import decode_samples

    for s in decode_samples(encode_samples(samples)):
        assert s.features.device.type == "cpu" and torch.equal(got[s.seq], s.features)
    train = [Sample(s.tokens, s.features, s.prompt_len) for s in samples]
    batch = batches(train, 64, 4, None)[0]
    assert batch.features.device.type == DEVICE
