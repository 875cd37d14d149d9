"""Capture: training samples from the serving forwards equal a teacher-forced target forward
(plain and speculative steps, n > 1 siblings), only the accepted path is kept, and the buffer
is bounded (eviction, sampling rate, aborts, weight changes mid-sequence, cursors, wire format).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tests.harness import PROMPTS
from tests.tiny import make_tiny_drafter
from tlt_serve import LLM, SamplingParams
from tlt_serve.backends.native.updates import EngineUpdates
from tlt_serve.config import CacheConfig, CaptureConfig, EngineConfig, ModelConfig, SpecConfig
from tlt_serve.engine.capture import (
    CaptureBuffer,
    TrainingSample,
    decode_samples,
    encode_samples,
    encode_shared,
)
from tlt_serve.engine.handoff import Lent, open_shared, share
from tlt_serve.engine.request import Request
from trainer.data import target_features


def capture_llm(path: Path, spec: SpecConfig | None = None, **capture: object) -> LLM:
    return LLM(
        config=EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32", max_model_len=256),
            cache=CacheConfig(max_num_seqs=8),
            spec=spec or SpecConfig(),
            capture=CaptureConfig(enabled=True, **capture),  # type: ignore[arg-type]
        )
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def check_against_teacher_forcing(llm: LLM, samples: list[TrainingSample]) -> None:
    seqs = [s.tokens.tolist() for s in samples]
    expect = target_features(llm.engine.model, seqs, batch_tokens=4096)
    for s, f in zip(samples, expect, strict=True):
        assert s.features.shape == f.shape
        torch.testing.assert_close(s.features, f, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_drafter(tiny_model_dir, tmp_path_factory.mktemp("cap") / "d", seed=4)


@pytest.mark.parametrize("mode", ["plain", "chain", "tree", "ngram"])
def test_samples_equal_teacher_forced_features(
    mode: str, tiny_model_dir: Path, drafter_dir: Path
) -> None:
    spec = {
        "plain": SpecConfig(),
        "chain": SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(drafter_dir)),
        "tree": SpecConfig(
            method="drafter", min_draft_confidence=0.0, drafter=str(drafter_dir), tree_topk=3,
        ),
        "ngram": SpecConfig(method="ngram"),
    }[mode]
    llm = capture_llm(tiny_model_dir, spec)
    lengths = [30, 5, 41, 17, 26]
    results = llm.generate(PROMPTS[:5], [greedy(n) for n in lengths])
    samples = llm.engine.capture.take(0, 1 << 30)
    assert len(samples) == 5
    by_prompt = {tuple(s.tokens[: s.prompt_len].tolist()): s for s in samples}
    for r, n in zip(results, lengths, strict=True):
        s = by_prompt[tuple(r.prompt_ids)]
        full = r.prompt_ids + r.samples[0].token_ids
        # Every position the target ran: all but the last generated token.
        assert s.tokens.tolist() == full[: len(full) - 1]
        assert s.prompt_len == len(r.prompt_ids) and s.weight_version == "0"
        assert len(r.samples[0].token_ids) == n
    check_against_teacher_forcing(llm, samples)
    if mode != "plain":
        assert llm.engine.stats.spec.steps > 0  # the speculative path really ran
    if mode in ("chain", "tree"):
        assert {s.drafter_version for s in samples} == {0}


def test_siblings_of_one_prompt_each_get_a_sample(tiny_model_dir: Path) -> None:
    llm = capture_llm(tiny_model_dir)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=7)
    res = llm.generate([PROMPTS[0]], params)[0]
    samples = llm.engine.capture.take(0, 1 << 30)
    assert len(samples) == 3
    outs = sorted(tuple(s.tokens[s.prompt_len :].tolist()) for s in samples)
    assert outs == sorted(tuple(x.token_ids[:-1]) for x in res.samples)
    check_against_teacher_forcing(llm, samples)


def test_rate_abort_and_weight_change_skip_sequences(tiny_model_dir: Path) -> None:
    llm = capture_llm(tiny_model_dir, sample_rate=0.5)
    llm.generate(PROMPTS * 8, greedy(3))
    stats = llm.engine.capture.stats()
    assert stats.captured + stats.skipped == len(PROMPTS) * 8
    assert 0.2 < stats.captured / (len(PROMPTS) * 8) < 0.8

    llm = capture_llm(tiny_model_dir)
    eng = llm.engine
    eng.add_request("a", eng.tokenizer.encode(PROMPTS[0]), greedy(20))
    eng.add_request("b", eng.tokenizer.encode(PROMPTS[1]), greedy(20))
    for _ in range(3):
        eng.step()
    eng.abort("a")
    embed = eng.model.embed_tokens.weight.detach().clone()
    EngineUpdates(eng).load([("model.embed_tokens.weight", embed)], "1")  # a new version
    while eng.has_work():
        eng.step()
    stats = eng.capture.stats()
    assert (stats.captured, stats.skipped) == (0, 2)  # a aborted, b mixed versions
    eng.add_request("c", eng.tokenizer.encode(PROMPTS[2]), greedy(5))
    while eng.has_work():
        eng.step()
    (c,) = eng.capture.take(0, 1 << 30)
    assert c.weight_version == "1" and c.seq == 1


def fake_sample(rid: str, n: int, h: int = 16) -> tuple[Request, torch.Tensor]:
    req = Request(rid=rid, prompt_ids=list(range(n)), params=greedy(1), detok=None)
    return req, torch.randn(n, h)


def test_buffer_evicts_oldest_and_cursors_page() -> None:
    buf = CaptureBuffer(CaptureConfig(enabled=True, max_bytes=10 * (16 * 4 + 8) * 10))
    for i in range(25):  # 10 positions each: 10 fit
        req, f = fake_sample(f"r{i}", 10)
        buf.observe([(req, f)], "0")
        buf.finish([req], None)
    st = buf.stats()
    assert (st.samples, st.captured, st.evicted, buf.last_seq) == (10, 25, 15, 25)
    assert st.bytes <= st.max_bytes and st.tokens == 100
    got = buf.take(0, 1 << 30)
    assert [s.seq for s in got] == list(range(16, 26))
    page = buf.take(17, max_bytes=1)  # always at least one
    assert [s.seq for s in page] == [18]
    assert [s.seq for s in buf.take(20, 3 * got[0].nbytes)] == [21, 22, 23]
    assert buf.take(25, 1 << 30) == []


def three_bf16_samples() -> list[TrainingSample]:
    buf = CaptureBuffer(CaptureConfig(enabled=True))
    for i in range(3):
        req, f = fake_sample(f"r{i}", 5 + i)
        buf.observe([(req, f.to(torch.bfloat16))], "v7")
        buf.finish([req], 3 if i else None)
    return buf.take(0, 1 << 30)


def test_wire_format_round_trip_and_malformed_blob() -> None:
    samples = three_bf16_samples()
    back = decode_samples(encode_samples(samples))
    for a, b in zip(samples, back, strict=True):
        assert (a.seq, a.prompt_len, a.weight_version, a.drafter_version) == (
            b.seq, b.prompt_len, b.weight_version, b.drafter_version)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)
        assert b.features.dtype == torch.bfloat16
    assert decode_samples(encode_samples([])) == []
    with pytest.raises(ValueError, match="malformed"):
        decode_samples(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError):
        decode_samples(b"abc")


BORROWER = """
import sys, torch
from tlt_serve.engine.capture import decode_samples
blob = sys.stdin.buffer.read()
out = {}
for s in decode_samples(blob):
    out[f"features.{s.seq}"] = s.features.contiguous()
    out[f"tokens.{s.seq}"] = s.tokens
torch.save(out, sys.argv[1])
"""


def test_features_by_reference_open_in_another_process(tmp_path: Path) -> None:
    """``encode_shared`` lends the features (here host shared memory; CUDA IPC on a GPU): a
    second process decodes the samples ``encode_samples`` sends by value, bit for bit, and
    owns its copy; the lender keeps only its last few loans alive."""
    import subprocess
    import sys

    samples = three_bf16_samples()
    lent = Lent(keep=2)
    blob = encode_shared(samples, lent)
    from safetensors.torch import load

    assert len(lent) == 1 and not [k for k in load(blob) if k.startswith("features")]
    out = tmp_path / "got.pt"
    run = subprocess.run([sys.executable, "-c", BORROWER, str(out)], input=blob,
                         capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    got = torch.load(out)
    for s in samples:
        assert torch.equal(got[f"features.{s.seq}"], s.features)
        assert got[f"features.{s.seq}"].dtype == torch.bfloat16
        assert torch.equal(got[f"tokens.{s.seq}"], s.tokens)
    here = decode_samples(blob)  # this process too; each sample owns its memory
    assert [s.seq for s in here] == [1, 2, 3]
    assert here[0].features.untyped_storage().data_ptr() != \
        here[1].features.untyped_storage().data_ptr()
    for _ in range(3):
        encode_shared(samples, lent)
    assert len(lent) == 2
    assert decode_samples(encode_shared([], lent)) == []


def test_a_shared_tensor_keeps_shape_offset_and_refuses_what_it_cannot_open() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[1:]  # a storage offset
    t = open_shared(share(view))
    assert torch.equal(t, view) and t.storage_offset() == 6
    with pytest.raises(ValueError, match="contiguous"):
        share(base.t())
    ref = share(base)
    for bad in ({**ref, "dtype": "nope"}, {**ref, "cpu": {**ref["cpu"], "handle": "00"}},
                {k: v for k, v in ref.items() if k != "shape"}):
        with pytest.raises(ValueError, match="cannot be opened"):
            open_shared(bad)


def vllm_capture_keeps(tmp_path: Path, prompt: list[int], output: list[int],
                       captured: list[int]) -> tuple[list[TrainingSample], torch.Tensor]:
    """One finished sample through the vLLM backend's capture, its worker answering with
    ``captured`` tokens (and a feature row each) from position 0: the samples kept and the
    features the worker sent."""
    from tlt_serve.backends.vllm.samples import VllmCapture

    features = torch.randn(len(captured), 16)

    async def rpc(method: str, **kwargs: object) -> list[str]:
        assert method == "tlt_capture_take" and kwargs["rids"] == ["internal"]
        save_file({"0.start": torch.tensor([0]), "0.tokens": torch.tensor(captured),
                   "0.features": features}, str(kwargs["path"]))
        return ["internal"]

    state = SimpleNamespace(version="3", drafter_version=1)
    cap = VllmCapture(state, rpc, tmp_path, CaptureConfig(enabled=True), seed=0)  # type: ignore[arg-type]
    cap.on_add("r", "internal", prompt)
    cap.on_output("r", output, SimpleNamespace(type="length"))
    asyncio.run(cap.fetch())
    return cap.buffer.take(0, 1 << 30), features


def test_vllm_capture_cuts_rows_past_the_served_ones_and_drops_a_mismatch(
    tmp_path: Path,
) -> None:
    """A step scheduled before a request finished (vLLM's async scheduling) may add rows
    past what was served: the sample keeps exactly the served positions. Tokens that differ
    from the served ones still drop it."""
    prompt, output = [1, 2, 3, 4], [5, 6, 7]
    served = prompt + output[:-1]
    (s,), features = vllm_capture_keeps(tmp_path, prompt, output, served + [7, 9])
    assert s.tokens.tolist() == served and s.prompt_len == len(prompt)
    assert torch.equal(s.features, features[: len(served)])
    assert (s.weight_version, s.drafter_version) == ("3", 1)
    (s,), _ = vllm_capture_keeps(tmp_path, prompt, output, served)
    assert s.tokens.tolist() == served
    assert vllm_capture_keeps(tmp_path, prompt, output, [1, 2, 3, 4, 8, 6, 7, 9])[0] == []
    assert vllm_capture_keeps(tmp_path, prompt, output, served[:-1])[0] == []
