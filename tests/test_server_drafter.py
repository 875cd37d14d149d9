"""Drafter endpoints over HTTP: hot-swap while requests run (outputs unchanged, versions
reported), drafter info, training pause and gate, the trainer's sample and target feeds."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from tests.harness import Served, make_llm, scrape, serve
from tests.tiny import make_tiny_drafter
from tlt_serve import SamplingParams
from tlt_serve.config import CaptureConfig, SpecConfig
from tlt_serve.engine.capture import decode_samples
from tlt_serve.flags import parse as parse_serve_flags
from tlt_serve.server.common.training import trainer_command
from trainer.cli import build_parser, online_config

PROMPTS = ["The quick brown fox", "def add(a, b):", "What is 12 + 7?", "Bonjour, ça va?"]
GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def drafters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("srv-drafters")
    return [make_tiny_drafter(tiny_model_dir, root / f"d{i}", seed=20 + i) for i in range(2)]


@pytest.fixture(scope="module")
def served_drafter(tiny_model_dir: Path, drafters: list[Path]) -> Iterator[Served]:
    spec = SpecConfig(
        method="drafter", min_draft_confidence=0.0, drafter=str(drafters[0]), max_batch=64,
    )
    s = serve(tiny_model_dir, spec=spec, capture=CaptureConfig(enabled=True))
    yield s
    s.stop()


def test_cli_capture_and_training_flags() -> None:
    cfg = parse_serve_flags(["--train-drafter", "--train-max-running", "2",
                      "--capture-max-mb", "64", "--capture-sample-rate", "0.5",
                      "--speculative", "auto", "--drafter", "/d", "--trainer-threads", "1"])
    assert cfg.engine.capture.enabled and cfg.training.enabled  # training implies capture
    assert (cfg.engine.capture.max_bytes, cfg.engine.capture.sample_rate) == (64 << 20, 0.5)
    assert cfg.training.max_running == 2 and cfg.training.threads == 1
    assert cfg.training.nice == 19  # default: the lowest CPU priority
    assert parse_serve_flags(["--trainer-nice", "5"]).training.nice == 5
    cmd = trainer_command(cfg, "http://127.0.0.1:1")
    assert cmd[cmd.index("--threads") + 1] == "1" and cmd[cmd.index("--init") + 1] == "/d"
    # The trainer parses it: one micro-step of 4 x 64 pairs per optimizer step (it is
    # suspended by signal, so a longer tick does not delay yielding).
    online = online_config(build_parser().parse_args(cmd[cmd.index("online"):]))
    assert (online.rows, online.row_len, online.accum, online.init) == (4, 64, 1, "/d")
    assert not parse_serve_flags([]).engine.capture.enabled


def test_cli_trainer_device_and_its_share_of_the_engines_gpu(capsys) -> None:
    """The trainer trains where the engine runs (its GPU, else the CPU) unless told; a memory
    budget reaches it, and on the engine's GPU the engine leaves it that much; a device the
    machine lacks is a one-line error."""
    from dataclasses import replace

    from tlt_serve.config import ModelConfig
    from tlt_serve.flags import _leave_the_trainer_its_share, engine_gpu

    cfg = parse_serve_flags(["--train-drafter", "--speculative", "drafter", "--drafter", "/d",
                             "--trainer-memory-gib", "2"])
    assert cfg.training.device == "cpu" and cfg.training.memory_bytes == 2 << 30
    assert cfg.engine.cache.gpu_reserve_bytes == 0  # no GPU: nothing to leave
    cmd = trainer_command(cfg, "http://127.0.0.1:1")
    online = online_config(build_parser().parse_args(cmd[cmd.index("online"):]))
    assert (online.device, online.memory_bytes) == ("cpu", 2 << 30)
    assert engine_gpu("native", "cuda:1") == "cuda:1" and engine_gpu("native", "cpu") is None
    on_gpu = replace(cfg, training=replace(cfg.training, device="cuda:1", memory_bytes=8 << 30),
                     engine=replace(cfg.engine, model=ModelConfig(device="cuda:1")))
    assert _leave_the_trainer_its_share(on_gpu).engine.cache.gpu_reserve_bytes == 8 << 30
    elsewhere = replace(on_gpu, training=replace(on_gpu.training, device="cuda:0"))
    assert _leave_the_trainer_its_share(elsewhere).engine.cache.gpu_reserve_bytes == 0
    # Beside the native engine on its GPU the trainer takes the features by reference, and its
    # store, there with them, gets half its budget; by value on the CPU or --capture-on-host.
    assert "--shared-feed" not in cmd
    cmd = trainer_command(on_gpu, "http://127.0.0.1:1")
    args = build_parser().parse_args(cmd[cmd.index("online"):])
    assert args.shared_feed and online_config(args).store.max_bytes == 4 << 30
    on_host = replace(on_gpu, engine=replace(on_gpu.engine, capture=replace(
        on_gpu.engine.capture, on_device=False)))
    assert "--shared-feed" not in trainer_command(on_host, "http://127.0.0.1:1")
    assert not parse_serve_flags(["--capture-on-host"]).engine.capture.on_device
    assert parse_serve_flags([]).engine.capture.on_device
    from trainer.cli import main as trainer_main

    with pytest.raises(SystemExit) as exc:
        trainer_main(["online", "--fleet", "http://127.0.0.1:9", "--shared-feed",
                      "--state-dir", "/nonexistent"])
    assert exc.value.code == 2
    assert "argument --shared-feed: not with --fleet" in capsys.readouterr().err
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            parse_serve_flags(["--train-drafter", "--speculative", "drafter", "--drafter", "/d",
                               "--trainer-device", "cuda"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1
        assert err[0].startswith("tlt-serve: --trainer-device cuda: "), err


def test_cli_training_needs_a_drafter(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_serve_flags(["--train-drafter"])
    assert exc.value.code == 2 and "--drafter" in capsys.readouterr().err


def test_swaps_under_load_keep_outputs_and_report_versions(
    served_drafter: Served, drafters: list[Path], tiny_model_dir: Path
) -> None:
    llm = make_llm(tiny_model_dir)
    expect = [
        r.samples[0].token_ids
        for r in llm.generate(PROMPTS, SamplingParams(max_new_tokens=48, temperature=0.0,
                                                      ignore_eos=True))
    ]
    stop = threading.Event()
    swaps: list[int] = []

    def swapper() -> None:
        with served_drafter.http() as http:
            while not stop.is_set():
                v = len(swaps) + 1
                body = {"path": str(drafters[v % 2]), "version": v}
                resp = http.post("/update_drafter_from_disk", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json() == {"success": True, "drafter_version": v,
                                       "message": f"serving drafter version {v}"}
                swaps.append(v)

    with ThreadPoolExecutor(1) as pool:
        swapping = pool.submit(swapper)
        try:
            with served_drafter.http() as http:
                outs = [http.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY})
                        for _ in range(3)]
        finally:
            stop.set()
        swapping.result(timeout=30)  # re-raises the swapper's failed assertion, if any
    assert len(swaps) >= 5
    for resp in outs:
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert [b["output_ids"] for b in body] == expect
        for b in body:
            meta = b["meta_info"]
            assert meta["drafter_versions"] == sorted(meta["drafter_versions"])
            assert meta["drafter_version"] == meta["drafter_versions"][-1]
    assert any(len(b["meta_info"]["drafter_versions"]) > 1 for r in outs for b in r.json())


def test_bad_swaps_get_400_naming_the_problem(served_drafter: Served, tmp_path: Path) -> None:
    with served_drafter.http() as http:
        before = http.get("/get_drafter_info").json()["drafter_version"]
        resp = http.post("/update_drafter_from_disk", json={"path": str(tmp_path / "nope")})
        assert resp.status_code == 400
        assert resp.json()["success"] is False and "not a directory" in resp.json()["message"]
        assert resp.json()["drafter_version"] == before
        resp = http.post("/update_drafter_from_disk", json={"path": "x", "versio": 3})
        assert resp.status_code == 400 and "versio" in resp.text
        resp = http.post("/update_drafter_from_disk", json={"path": "x", "version": -1})
        assert resp.status_code == 400 and "version" in resp.text
        assert http.get("/get_drafter_info").json()["drafter_version"] == before


def test_samples_feed_pages_with_a_cursor(served_drafter: Served) -> None:
    with served_drafter.http() as http:
        newest = int(http.get("/drafter/samples", params={"after": 0}).headers["x-newest-seq"])
        resp = http.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY})
        assert resp.status_code == 200
        got = http.get("/drafter/samples", params={"after": newest})
        assert got.status_code == 200 and got.headers["content-type"] == "application/octet-stream"
        samples = decode_samples(got.content)
        assert len(samples) == len(PROMPTS) == int(got.headers["x-count"])
        assert [s.seq for s in samples] == list(range(newest + 1, newest + 5))
        outs = sorted(tuple(b["output_ids"][:-1]) for b in resp.json())
        assert sorted(tuple(s.tokens[s.prompt_len:].tolist()) for s in samples) == outs
        last = got.headers["x-last-seq"]
        again = http.get("/drafter/samples", params={"after": last})
        assert decode_samples(again.content) == [] and again.headers["x-count"] == "0"
        one = http.get("/drafter/samples", params={"after": newest, "max_bytes": 1})
        assert one.headers["x-count"] == "1"
        bad = http.get("/drafter/samples", params={"after": -1})
        assert bad.status_code == 400 and "after" in bad.text
        info = http.get("/get_drafter_info").json()
        assert info["capture"]["samples"] >= len(PROMPTS) and info["capture"]["enabled"]
        assert info["recent_verify_steps"] > 0
        assert 0 <= info["recent_accept_length"] <= SpecConfig().num_draft_tokens


def test_samples_by_reference_equal_samples_by_value(served_drafter: Served) -> None:
    """``share=true`` (a trainer on the server's machine): the engine process lends the
    features (host shared memory here, CUDA IPC on a GPU) and this process reads the samples
    the by-value feed sends, bit for bit; a trainer's link asks for it with ``share``."""
    from safetensors.torch import load as load_blob

    from tlt_serve.engine.capture import header_metadata
    from trainer.link import ServerLink

    with served_drafter.http() as http:
        newest = int(http.get("/drafter/samples", params={"after": 0}).headers["x-newest-seq"])
        resp = http.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY})
        assert resp.status_code == 200
        by_value = http.get("/drafter/samples", params={"after": newest})
        lent = http.get("/drafter/samples", params={"after": newest, "share": "true"})
        assert lent.status_code == 200 and lent.headers["x-count"] == str(len(PROMPTS))
    assert "features_ref" in header_metadata(lent.content)
    assert not [k for k in load_blob(lent.content) if k.startswith("features")]
    want, got = decode_samples(by_value.content), decode_samples(lent.content)
    assert len(got) == len(want) == len(PROMPTS)
    for a, b in zip(want, got, strict=True):
        assert (a.seq, a.prompt_len, a.weight_version) == (b.seq, b.prompt_len, b.weight_version)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)
    link = ServerLink(served_drafter.base_url, share=True)
    try:
        pulled, _ = link.samples(newest, 1 << 30)
    finally:
        link.close()
    assert [torch.equal(p.features, a.features) for p, a in zip(pulled, want, strict=True)] \
        == [True] * len(PROMPTS)


def test_target_feed_matches_the_served_model(served_drafter: Served, tiny_model_dir) -> None:
    with served_drafter.http() as http:
        resp = http.get("/drafter/target")
    assert resp.status_code == 200 and resp.headers["x-weight-version"] == "0"
    tensors = load(resp.content)
    model = make_llm(tiny_model_dir).engine.model
    assert torch.equal(tensors["model.embed_tokens.weight"], model.embed_tokens.weight)
    assert torch.equal(tensors["model.norm.weight"], model.norm.weight)


def test_training_pause_gate_and_trainer_report(served_drafter: Served) -> None:
    with served_drafter.http() as http:
        gate = http.get("/drafter/gate").json()
        assert gate["train"] is True and gate["in_flight"] == 0 and gate["max_running"] == 0
        assert http.post("/pause_drafter_training").json()["paused"] is True
        gate = http.get("/drafter/gate").json()
        assert gate["train"] is False and gate["reason"] == "training paused"
        report = {"state": "training", "step": 12, "published_version": 3, "loss": 0.5}
        assert http.post("/drafter/trainer_status", json=report).json()["paused"] is True
        assert http.post("/drafter/trainer_status", json={"stat": "x"}).status_code == 400
        assert scrape(http).value("tlt_serve_trainer_state", state="paused") == 1
        http.post("/resume_drafter_training")
        info = http.get("/get_drafter_info").json()["training"]
        assert info["paused"] is False and info["gate"]["train"] is True
        assert info["trainer"]["step"] == 12 and info["trainer"]["published_version"] == 3
        m = scrape(http)  # a standalone trainer, seen through its reports
        assert m.value("tlt_serve_trainer_state", state="training") == 1
        assert m.value("tlt_serve_trainer_state") == 1  # exactly one state is set
        http.post("/drafter/trainer_status", json={"state": "waiting"})
        assert scrape(http).value("tlt_serve_trainer_state", state="idle") == 1


def test_metrics_follow_drafter_capture_and_speculation_under_load(
    served_drafter: Served, drafters: list[Path]
) -> None:
    with served_drafter.http() as http:
        before = scrape(http)
        swap = http.post("/update_drafter_from_disk", json={"path": str(drafters[1]),
                                                              "version": 1000})
        assert swap.status_code == 200, swap.text
        resp = http.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY})
        assert resp.status_code == 200, resp.text
        after = scrape(http)
        info = http.get("/get_drafter_info").json()
    assert after.value("tlt_serve_drafter_version") == 1000 == info["drafter_version"]
    assert after.value("tlt_serve_capture_buffer_bytes") == info["capture"]["bytes"]
    assert after.value("tlt_serve_capture_buffer_samples") == info["capture"]["samples"]
    assert after.value("tlt_serve_capture_buffer_samples") >= len(PROMPTS)
    if info["capture"]["evicted"] == 0:  # the buffer only grew
        assert after.value("tlt_serve_capture_buffer_bytes") > before.value(
            "tlt_serve_capture_buffer_bytes")
    # Four sequences decode together: their verify steps land in the 2-4 bucket, and in 1
    # for the last one if they finish apart; every sequence's verifies are counted once.
    def grown(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, missing=0.0, **labels)

    assert grown("tlt_serve_spec_verify_steps_total", batch_bucket="2-4") > 0
    assert after.labels("tlt_serve_spec_verify_steps_total", "batch_bucket") <= {"1", "2-4"}
    assert grown("tlt_serve_spec_sequence_verifies_total") == sum(
        b["meta_info"]["spec_draft_steps"] for b in resp.json())
    assert after.value("tlt_serve_spec_accept_length_recent") == pytest.approx(
        info["recent_accept_length"], abs=1e-4)


def test_samples_need_capture(served: Served) -> None:
    with served.http() as http:
        resp = http.get("/drafter/samples")
        assert resp.status_code == 400 and "--capture" in resp.text
        info = http.get("/get_drafter_info").json()
        assert info["drafter_version"] is None and info["capture"]["enabled"] is False
