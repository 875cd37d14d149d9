"""The online trainer against a real server: it pulls captured samples, trains only while
the gate is open, publishes a candidate only when the promotion guard scores it better, the
server serves it (outputs still exact), and a restarted trainer resumes from its checkpoint
(skipping a corrupt one)."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.harness import (
    ROLLOUT_PROMPTS,
    Served,
    make_llm,
    read_ready_url,
    serve,
    start_cli,
    wait_for,
)
from tests.tiny import make_tiny_drafter
from tlt_serve import SamplingParams
from tlt_serve.config import CaptureConfig, SpecConfig
from tlt_serve.models.loader import build_model
from tlt_serve.speculative.checkpoint import load_drafter
from trainer.link import ServerLink, TargetTensors
from trainer.online import OnlineConfig, OnlineTrainer
from trainer.state import checkpoints
from trainer.store import StoreConfig
from trainer.target import borrowed_tensors, head_stub


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_drafter(tiny_model_dir, tmp_path_factory.mktemp("online") / "d", seed=31)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, drafter_dir: Path) -> Iterator[Served]:
    spec = SpecConfig(
        method="drafter", min_draft_confidence=0.0, drafter=str(drafter_dir), max_batch=64,
    )
    s = serve(tiny_model_dir, spec=spec, capture=CaptureConfig(enabled=True))
    yield s
    s.stop()


def rollout(s: Served, n: int = 4, temperature: float = 1.0) -> list[dict]:
    params = {"max_new_tokens": 48, "temperature": temperature, "n": n, "ignore_eos": True}
    with s.http(timeout=600) as http:  # generous: CI machines are shared
        resp = http.post("/generate", json={"text": ROLLOUT_PROMPTS, "sampling_params": params})
    assert resp.status_code == 200, resp.text
    out: list[dict] = resp.json()
    return out


def config(server: Served, state: Path, drafter_dir: Path, **kw: object) -> OnlineConfig:
    base: dict[str, object] = {
        "server": server.base_url, "state_dir": str(state), "init": str(drafter_dir),
        "row_len": 64, "accum": 2, "lr": 3e-3, "min_train_tokens": 256, "pull_every_s": 0.0,
        "eval_every": 10, "eval_rows": 4, "checkpoint_every": 10, "report_every_s": 0.0,
        "store": StoreConfig(heldout_every=4),
    }
    return OnlineConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_trains_publishes_and_serves_exactly(
    server: Served, drafter_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    rollout(server)
    trainer = OnlineTrainer(config(server, tmp_path, drafter_dir), ServerLink(server.base_url))
    assert trainer.tick() == "pulled" and trainer.cursor == len(ROLLOUT_PROMPTS) * 4
    did = [trainer.tick() for _ in range(400) if trainer.published_version == 0]
    assert "published" in did, trainer.verdict
    assert trainer.verdict and trainer.verdict["candidate"] > trainer.verdict["served"]
    assert (tmp_path / "published" / "v1" / "config.json").is_file()
    trainer.report()
    with server.http() as http:
        info = http.get("/get_drafter_info").json()
        assert info["drafter_version"] == 1
        assert info["training"]["trainer"]["published_version"] == 1
        assert info["training"]["trainer"]["device"] == "cpu"  # OnlineConfig's default
    expect = make_llm(tiny_model_dir).generate(
        ROLLOUT_PROMPTS, SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True))
    for got, want in zip(rollout(server, n=1, temperature=0.0), expect, strict=True):
        assert got["output_ids"] == want.samples[0].token_ids
        assert got["meta_info"]["drafter_versions"] == [1]


def test_a_trainer_fed_by_reference_stores_what_the_feed_sends_and_trains(
    server: Served, drafter_dir: Path, tmp_path: Path
) -> None:
    """``--shared-feed``: the store holds the samples the by-value feed sends, and training
    draws batches from them; with a byte cap (a store on a GPU: half the trainer's budget)
    the oldest go first and the newest stays."""
    rollout(server)
    shared = OnlineTrainer(config(server, tmp_path / "a", drafter_dir),
                           ServerLink(server.base_url, share=True))
    by_value = OnlineTrainer(config(server, tmp_path / "b", drafter_dir),
                             ServerLink(server.base_url))
    assert shared.tick() == "pulled" and by_value.tick() == "pulled"
    a = [s.sample for s in (*shared.store.train, *shared.store.heldout)]
    b = [s.sample for s in (*by_value.store.train, *by_value.store.heldout)]
    assert len(a) == len(b) > 0
    assert all(torch.equal(x.features, y.features) and torch.equal(x.tokens, y.tokens)
               for x, y in zip(a, b, strict=True))
    assert "trained" in {shared.tick() for _ in range(3)}
    one = shared.store.train[-1].sample.features.nbytes
    capped = OnlineTrainer(
        config(server, tmp_path / "c", drafter_dir, store=StoreConfig(heldout_every=4,
                                                                      max_bytes=4 * one)),
        ServerLink(server.base_url, share=True))
    capped.tick()
    kept = [s.sample for s in capped.store.train]
    assert 1 <= len(kept) < len(shared.store.train)
    assert sum(s.features.nbytes for s in kept) <= 3 * one or len(kept) == 1
    assert torch.equal(kept[-1].features, shared.store.train[-1].sample.features)


def test_waits_while_busy_or_paused(server: Served, drafter_dir: Path, tmp_path: Path) -> None:
    trainer = OnlineTrainer(config(server, tmp_path, drafter_dir), ServerLink(server.base_url))
    with server.http() as http:
        http.post("/pause_drafter_training")
        assert trainer.tick() == "waiting"
        http.post("/resume_drafter_training")
    busy = threading.Thread(target=rollout, args=(server, 16))
    busy.start()
    try:
        seen = set()
        while busy.is_alive():
            seen.add(trainer.tick())
    finally:
        busy.join()
    assert "waiting" in seen
    wait_for(lambda: trainer.tick() != "waiting")  # the last response may still be closing


def test_restart_resumes_and_skips_a_corrupt_checkpoint(
    server: Served, drafter_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rollout(server)
    cfg = config(server, tmp_path, drafter_dir)
    first = OnlineTrainer(cfg, ServerLink(server.base_url))
    while first.step < 3:
        first.tick()
    saved = first.checkpoint()
    (tmp_path / "ckpt-999999999.pt").write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.ERROR, logger="trainer.state"):
        again = OnlineTrainer(cfg, ServerLink(server.base_url))
    assert "ckpt-999999999.pt is unusable" in caplog.text
    assert again.resumed_from == (str(saved), first.step)
    assert (again.step, again.cursor, again.published_version) == (
        first.step, first.cursor, first.published_version)
    assert_same(again.drafter.state_dict(), first.drafter.state_dict())
    assert_same(again.opt.state_dict(), first.opt.state_dict())  # AdamW moments and steps
    assert saved in checkpoints(tmp_path)


def assert_same(got: object, want: object, where: str = "") -> None:
    """Nested dicts / lists of tensors and numbers, equal to the bit."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    else:
        assert got == want, where


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_server_supervises_the_trainer_through_sigkill(
    tiny_model_dir: Path, drafter_dir: Path, tmp_path: Path
) -> None:
    """--train-drafter: the server starts the trainer and suspends it while requests run;
    SIGKILL mid-training leaves serving untouched, the supervisor restarts it, and it
    resumes from its checkpoint. With separate API and admin keys the trainer gets the admin
    key (it pulls samples and swaps drafters). SIGTERM aborts the request in flight (partial
    output) and the trainer writes a checkpoint on its way out."""
    state = tmp_path / "state"
    proc = start_cli(str(tiny_model_dir), "--max-num-seqs", "8", "--speculative", "drafter",
                     "--min-draft-confidence", "0",
                     "--drafter", str(drafter_dir), "--train-drafter", "--trainer-state-dir",
                     str(state), "--api-key", "user-key", "--admin-key", "admin-key")
    try:
        url = read_ready_url(proc)
        headers = {"Authorization": "Bearer user-key"}
        with httpx.Client(base_url=url, timeout=600, headers=headers) as http:
            params = {"max_new_tokens": 48, "temperature": 1.0, "n": 8, "ignore_eos": True}
            assert http.post("/generate", json={"text": ROLLOUT_PROMPTS, "sampling_params": params}
                             ).status_code == 200

            def training() -> dict:
                return http.get("/get_drafter_info").json()["training"]

            wait_for(lambda: checkpoints(state), timeout=300, interval=0.5)
            ckpt_step = int(checkpoints(state)[0].stem.split("-")[1])
            first = training()
            assert first["enabled"] and first["pid"] and first["restarts"] == 0
            # Lowest CPU priority: it trains on cycles nothing else on the machine wants.
            assert os.getpriority(os.PRIO_PROCESS, first["pid"]) == 19
            # Load returns: the server suspends the trainer at once, and resumes it after.
            long = {"max_new_tokens": 200, "temperature": 0, "n": 4, "ignore_eos": True}
            body = {"text": ROLLOUT_PROMPTS[0], "sampling_params": long}
            busy = threading.Thread(target=http.post, args=("/generate",), kwargs={"json": body})
            # Generation paused in place first: the request stays in flight until continued,
            # so the checks cannot race its end (a fast machine finishes it in a blink).
            admin = {"Authorization": "Bearer admin-key"}
            assert http.post("/pause_generation", json={"mode": "in_place"},
                             headers=admin).status_code == 200
            busy.start()
            wait_for(lambda: training()["suspended"], timeout=30, interval=0.01)
            wait_for(lambda: proc_state(first["pid"]) == "T", timeout=5, interval=0.01)
            assert busy.is_alive()
            assert http.post("/continue_generation", headers=admin).status_code == 200
            busy.join()
            wait_for(lambda: not training()["suspended"], timeout=30)
            assert proc_state(first["pid"]) != "T"
            os.kill(first["pid"], signal.SIGKILL)
            newest = checkpoints(state)[0]  # nothing writes one any more
            out = http.post("/generate", json={"text": ROLLOUT_PROMPTS[0], "sampling_params": {
                "max_new_tokens": 8, "temperature": 0}})
            assert out.status_code == 200 and len(out.json()["output_ids"]) == 8
            after = wait_for(lambda: (t := training())["restarts"] == 1 and t["pid"] and t,
                             timeout=60)
            assert after["pid"] != first["pid"]
            resumed = wait_for(lambda: (t := training()["trainer"])["pid"] == after["pid"] and t,
                               timeout=120, interval=0.5)
            # It started from the newest checkpoint (whose state equals the trainer's that
            # wrote it: test_restart_resumes_and_skips_a_corrupt_checkpoint), not from 0.
            assert resumed["resumed_from"] == str(newest)
            assert resumed["resumed_step"] == int(newest.stem.split("-")[1]) >= ckpt_step
            assert resumed["step"] >= resumed["resumed_step"]
            assert resumed["device"] == "cpu"  # the engine runs on the CPU: so does its trainer
            sigterm_with_a_stream_in_flight(proc, url, headers, state)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def sigterm_with_a_stream_in_flight(
    proc: subprocess.Popen[str], url: str, headers: dict[str, str], state: Path
) -> None:
    events: list = []
    body = {"text": ROLLOUT_PROMPTS[0], "stream": True,
            "sampling_params": {"max_new_tokens": 240, "temperature": 0, "ignore_eos": True}}

    def stream() -> None:
        with httpx.Client(base_url=url, timeout=120, headers=headers) as c, c.stream(
            "POST", "/generate", json=body
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: "):]))

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    wait_for(lambda: len(events) >= 2, timeout=60, interval=0.01)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert proc.wait(60) in (0, -signal.SIGTERM)
    assert events and events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(events[-1]["output_ids"]) < 240  # the partial output came back
    newest = checkpoints(state)[0]
    assert newest.stat().st_mtime >= sent - 1  # written on the way out



def test_a_fused_drafter_is_refused_with_the_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Capture keeps a fused drafter's input features, not the final hidden states its loss
    needs: the online trainer says so at start instead of failing on shapes mid-training."""
    fused = make_tiny_drafter(tiny_model_dir, tmp_path / "fused", seed=5, feature_layers=(0, 1))
    spec = SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(fused))
    s = serve(tiny_model_dir, spec=spec, capture=CaptureConfig(enabled=True))
    try:
        cfg = config(s, tmp_path / "state", fused, init=None)
        with pytest.raises(ValueError, match=r"^feature_layers: .*fuses target layers \[0, 1\]"):
            OnlineTrainer(cfg, ServerLink(s.base_url))
    finally:
        s.stop()


class LocalTarget:
    """What the server's feed hands the trainer of the tiny target (``scale`` times its
    tensors), without a server."""

    def __init__(self, model_dir: Path) -> None:
        self.model = build_model(model_dir, torch.float32, 256)
        self.hf = json.loads((model_dir / "config.json").read_text())

    def target(self, scale: float = 1.0, version: str = "0") -> TargetTensors:
        tensors = {k: v * scale for k, v in borrowed_tensors(self.model).items()}
        return TargetTensors(self.model.cfg, self.hf, tensors, version)

    def drafter_info(self) -> dict[str, object]:
        return {"drafter_version": 0}


def test_drafter_copies_share_the_target_and_follow_its_refresh(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The served drafter and a candidate are copies of the trained one: each has its own
    weights but reads the trainer's one fp32 target stand-in, so a target refresh reaches
    the served drafter's (sliced) head."""
    init = make_tiny_drafter(tiny_model_dir, tmp_path / "d", seed=3, draft_vocab_size=64)
    link = LocalTarget(tiny_model_dir)
    cfg = OnlineConfig(state_dir=str(tmp_path / "state"), init=str(init))
    trainer = OnlineTrainer(cfg, link)  # type: ignore[arg-type]
    stub, drafter = trainer.stub, trainer.drafter
    for copied in (trainer.served, copy.deepcopy(drafter)):
        assert copied.target is stub
        for name in ("embed_tokens", "lm_head"):
            got, want = getattr(copied.target, name).weight, getattr(stub, name).weight
            assert got.data_ptr() == want.data_ptr()
        for (name, p), (_, q) in zip(drafter.named_parameters(), copied.named_parameters(),
                                     strict=True):
            assert p.data_ptr() != q.data_ptr() and torch.equal(p, q), name
    trainer._refresh_target(link.target(scale=1.5, version="1"))
    fresh = load_drafter(init, head_stub(stub.cfg, link.target(scale=1.5).tensors, 256))
    hidden = torch.randn(3, stub.cfg.hidden_size)
    torch.testing.assert_close(trainer.served.draft_logits(hidden), fresh.draft_logits(hidden))
