"""``tlt-train warmup`` on a tiny model: trains, loads, stays lossless, is reproducible."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.engine.runner import extend_batch
from tlt_serve.models.loader import build_model
from tlt_serve.models.tokenizer import load_tokenizer
from tlt_serve.speculative.checkpoint import load_drafter
from tlt_serve.speculative.drafter import DrafterModel, DrafterSpec, new_drafter
from trainer.cli import build_parser, config_from_args, main
from trainer.data import Sample
from trainer.evaluate import walk
from trainer.packing import batches, make_batch, pack_rows, segments
from trainer.prompts import build_prompts
from trainer.target import head_target
from trainer.train import TrainConfig, step_loss
from trainer.unroll import chain_forward, shift
from trainer.warmup import WarmupResult, warmup

# Seconds, not minutes: few prompts, short answers, small packed rows, one thread; template
# prompts (a tiny random model rarely ends a user turn of its own).
TINY = [
    "--prompts", "templates", "--num-prompts", "72", "--heldout", "8", "--max-new-tokens", "48",
    "--draft-vocab", "256",
    "--steps", "150", "--batch-tokens", "512", "--row-len", "128", "--lr", "1e-3",
    "--threads", "1", "--dtype", "float32", "--seed", "3",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    """Engines and warm-ups set torch's global thread count; give it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its final norm scaled x8: peaked next-token distributions.

    The plain tiny model's distributions are nearly uniform (soft labels carry no signal)
    and its greedy answers are one repeated token, which the untrained drafter (a feature
    pass-through) already predicts; sharper logits give sampled data some structure."""
    out = tmp_path_factory.mktemp("sharp") / "llama"
    shutil.copytree(tiny_model_dir, out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 8
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def trained(sharp_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> WarmupResult:
    out = tmp_path_factory.mktemp("warm") / "drafter"
    args = build_parser().parse_args(
        ["warmup", "--model", str(sharp_model_dir), "--out", str(out), *TINY]
    )
    return warmup(config_from_args(args))


def test_prompts_are_distinct_balanced_and_deterministic() -> None:
    prompts = build_prompts(600, seed=1)
    assert len(set(prompts)) == 600 and prompts == build_prompts(600, seed=1)
    assert prompts != build_prompts(600, seed=2)
    assert sum("Python" in p for p in prompts) >= 200  # every third one is a code task


def test_loss_decreases_and_beats_the_untrained_drafter(trained: WarmupResult) -> None:
    loss = trained.history.loss
    assert sum(loss[-15:]) / 15 < 0.8 * sum(loss[:15]) / 15
    assert trained.accept.accept_length > trained.accept_untrained.accept_length + 0.3
    assert trained.accept.chains > 100
    report = trained.report
    assert report["offline"]["trained"]["accept_length"] == round(trained.accept.accept_length, 4)
    assert report["data"]["heldout_sequences"] == 8 and report["timings"]["total_s"] > 0


def serve_greedy(model_dir: Path, spec: SpecConfig) -> tuple[list[list[int]], LLM]:
    """Greedy answers of the tiny model to four unseen prompts, with ``spec``."""
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(max_num_seqs=4),
        spec=spec,
        num_threads=1,
    )
    llm = LLM(config=config)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
               for p in build_prompts(4, seed=99)]  # fmt: skip
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    return [g.samples[0].token_ids for g in llm.generate(prompts, params)], llm


def assert_serves_losslessly_with_accepted_drafts(drafter: Path, model_dir: Path) -> None:
    plain, _ = serve_greedy(model_dir, SpecConfig())
    spec = SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(drafter))
    out, llm = serve_greedy(model_dir, spec)
    assert out == plain
    assert llm.engine.stats.spec.accepted > 0


def test_checkpoint_serves_losslessly_with_accepted_drafts(
    trained: WarmupResult, sharp_model_dir: Path
) -> None:
    target = build_model(sharp_model_dir, torch.float32, 256)
    drafter = load_drafter(trained.path, target)
    assert drafter.spec.draft_vocab_size == 256 and drafter.spec.version == 1
    assert_serves_losslessly_with_accepted_drafts(trained.path, sharp_model_dir)


def test_fused_warmup_trains_a_drafter_that_serves_losslessly(
    sharp_model_dir: Path, tmp_path: Path
) -> None:
    """--feature-layers: an EAGLE-3 style drafter reading two target layers' residual
    streams, trained to predict the final hidden state; the engine serves it exactly."""
    args = build_parser().parse_args([
        "warmup", "--model", str(sharp_model_dir), "--out", str(tmp_path / "fused"), *TINY,
        "--feature-layers", "0,1",
    ])  # fmt: skip
    result = warmup(config_from_args(args))
    loss = result.history.loss
    assert sum(loss[-15:]) / 15 < 0.8 * sum(loss[:15]) / 15
    assert result.accept.accept_length > result.accept_untrained.accept_length + 0.3
    target = build_model(sharp_model_dir, torch.float32, 256)
    assert load_drafter(result.path, target).spec.feature_layers == (0, 1)
    assert_serves_losslessly_with_accepted_drafts(result.path, sharp_model_dir)


def test_same_seed_same_checkpoint_via_the_cli(
    trained: WarmupResult, sharp_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "again"
    assert main(["warmup", "--model", str(sharp_model_dir), "--out", str(out), *TINY]) == 0
    first = load_file(trained.path / "model.safetensors")
    again = load_file(out / "model.safetensors")
    assert first.keys() == again.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
    assert (out / "warmup.json").is_file() and (out / "config.json").is_file()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--steps", "0"], "--steps"),
        (["--num-prompts", "1"], "--num-prompts"),
        (["--prompts", "hub"], "--prompts"),
        (["--heldout", "72"], "--heldout"),
        (["--max-new-tokens", "1"], "--max-new-tokens"),
        (["--draft-vocab", "-1"], "--draft-vocab"),
        (["--batch-tokens", "64"], "--batch-tokens"),
        (["--threads", "0"], "--threads"),
        (["--dtype", "float16"], "--dtype"),
        (["--steps", "many"], "--steps"),
        (["--model", "/nonexistent/model"], "--model"),
        (["--feature-layers", "0,0"], "--feature-layers"),
        (["--feature-layers", "0,x"], "--feature-layers"),
        (["--feature-layers", "0,99"], "--feature-layers"),
    ],
)
def test_cli_rejects_bad_args_naming_the_flag(argv, flag, tiny_model_dir, tmp_path, capsys) -> None:
    # Tiny settings first (the bad flag overrides its own): a case that were wrongly
    # accepted would cost seconds, not a real warm-up.
    base = ["warmup", "--model", str(tiny_model_dir), "--out", str(tmp_path / "d"), *TINY]
    with pytest.raises(SystemExit) as exc:
        main([*base, *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_requires_out(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["warmup"])
    assert "--out" in capsys.readouterr().err


# ---- the packed, unrolled forward is the forward drafting runs -------------------------------


def _drafter(model_dir: Path) -> DrafterModel:
    target = build_model(model_dir, torch.float32, 256)
    drafter = new_drafter(head_target(target, 256), DrafterSpec(), seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from the pass-through init, so every weight matters
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return drafter


def _samples(drafter: DrafterModel, lengths: list[int], seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    V, H = drafter.cfg.vocab_size, drafter.cfg.hidden_size
    return [
        Sample(torch.randint(0, V, (n,), generator=gen), torch.randn(n, H, generator=gen), 4)
        for n in lengths
    ]


def test_packed_chain_forward_equals_per_sequence_drafting(tiny_model_dir: Path) -> None:
    """Block 0 = catch-up over true pairs; block 1 = one drafted pair on top (the proposer's
    KV layout), for several sequences packed into one row."""
    drafter = _drafter(tiny_model_dir).eval()
    samples = _samples(drafter, [9, 14, 6])
    (row,) = pack_rows(segments(samples, 64), 64, rng=None)  # all three share one row
    b = make_batch([row], samples)
    with torch.no_grad():
        outs = chain_forward(
            drafter, b.tokens, b.features, b.seg, b.positions, 2, lambda j, _: shift(b.tokens, j)
        )
        q = 0
        for seg in row:
            s, n = samples[seg.sample], seg.end - seg.start
            for t in range(n - 1):  # chain from pair t: true pairs 0..t, then (f̂_{t+1}, x_{t+2})
                kv = KVCache(drafter.cfg, 1, 64, torch.float32)
                fb, ids = extend_batch(kv, 0, [0], [s.tokens[1 : t + 2].tolist()])
                out = drafter(ids, s.features[: t + 1].unsqueeze(0), fb, kv.layers[0])
                torch.testing.assert_close(out[0, -1], outs[0][0, q + t], atol=1e-5, rtol=1e-5)
                fb, ids = extend_batch(kv, 0, [t + 1], [[int(s.tokens[t + 2])]])
                nxt = drafter(ids, out[:, -1:], fb, kv.layers[0], fused=True)
                torch.testing.assert_close(nxt[0, 0], outs[1][0, q + t], atol=1e-5, rtol=1e-5)
            q += n


def test_gradients_reach_every_trainable_weight_and_spare_the_target(tiny_model_dir) -> None:
    drafter = _drafter(tiny_model_dir).train()
    samples = _samples(drafter, [30, 20, 25])
    (b,) = batches(samples, row_len=128, rows_per_batch=2, rng=random.Random(0))
    loss, f_loss, ce = step_loss(drafter, b, TrainConfig(unroll=2), torch.zeros_like(b.features))
    loss.backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert drafter.target.embed_tokens.weight.grad is None
    assert f_loss > 0 and ce > 0


def test_walk_starts_each_chain_past_the_previous_chains_accepted_drafts_and_bonus() -> None:
    # One row, two segments: slots 0-6 (seg 0, chains may start at 1..6) and 7-11 (seg 1).
    lengths = torch.tensor([[3, 2, 0, 4, 1, 1, 0, 9, 0, 2, 0, 0]])
    start = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    seg = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    # seg 0: slot 1 (2 accepted) → slot 4 (1) → slot 6 (0); seg 1: slot 8 (0) → 9 (2) → end.
    assert walk(lengths, start, seg) == [2, 1, 0, 0, 2]
    # Padding (-1) and non-start slots never start a chain.
    assert walk(lengths, torch.zeros_like(start), seg) == []


def test_both_prompt_sources_alternate_so_the_heldout_tail_holds_each(
    sharp_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The target's own user turns are tested on the real model (test_real_model.py); a tiny
    # random model rarely ends a turn, so here the writer is a stand-in and the wiring is tested.
    import trainer.warmup as warmup_module

    asked: list[int] = []

    def written(llm: LLM, tokenizer: object, n: int, seed: int) -> list[str]:
        asked.append(n)
        return [f"written number {i}" for i in range(n)]

    monkeypatch.setattr(warmup_module, "self_prompts", written)
    argv = ["warmup", "--model", str(sharp_model_dir), "--out", str(tmp_path / "d"), *TINY]
    argv += ["--prompts", "both", "--num-prompts", "9", "--heldout", "2", "--max-new-tokens", "4"]
    cfg = config_from_args(build_parser().parse_args(argv))
    data = warmup_module.collect(cfg, sharp_model_dir, {})
    tok = load_tokenizer(sharp_model_dir)
    is_written = ["written number" in tok.decode(p) for p in data.prompts]
    assert asked == [4] and len(data.responses) == 9
    assert is_written == [False, True] * 4 + [False]
    assert all(len(r) >= 1 for r in data.responses)
