"""One drafter trainer for a fleet (``tlt-train online --fleet ROUTER_URL``): it pulls the
samples every replica captured, trains while some replica is idle, publishes each drafter
to every replica under one version, brings a replica that joins later up to it, and goes on
when a replica leaves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import ROLLOUT_PROMPTS, Served, need_router, serve, wait_for
from tests.tiny import make_tiny_drafter
from tlt_serve.config import CaptureConfig, SpecConfig
from tlt_serve.fleet.router_api import RouterApi
from tlt_serve.fleet.router_proc import RouterProcess, free_port
from trainer.fleet_link import FleetLink
from trainer.online import OnlineConfig, OnlineTrainer
from trainer.store import StoreConfig

need_router()


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_drafter(tiny_model_dir, tmp_path_factory.mktemp("fleet") / "d", seed=31)


def replica(model_dir: Path, drafter_dir: Path) -> Served:
    spec = SpecConfig(method="drafter", min_draft_confidence=0.0, drafter=str(drafter_dir),
                      max_batch=64)
    return serve(model_dir, spec=spec, capture=CaptureConfig(enabled=True))


@pytest.fixture
def fleet(tiny_model_dir: Path, drafter_dir: Path) -> Iterator[tuple[str, list[Served]]]:
    router = RouterProcess("127.0.0.1", free_port(), [])
    replicas: list[Served] = []
    try:
        router.wait_up()
        replicas = [replica(tiny_model_dir, drafter_dir) for _ in range(2)]
        api = RouterApi(router.url)
        for r in replicas:
            api.add(r.base_url)
        api.wait_healthy([r.base_url for r in replicas], timeout=60)
        yield router.url, replicas
    finally:
        for r in replicas:
            r.stop()
        router.stop()


def drafter_of(url: str) -> tuple[int | None, str | None]:
    info = httpx.get(f"{url}/get_drafter_info", timeout=30).json()
    return info["drafter_version"], info["drafter_path"]


def test_one_trainer_feeds_on_and_publishes_to_every_replica(
    fleet, tiny_model_dir: Path, drafter_dir: Path, tmp_path: Path
) -> None:
    router_url, replicas = fleet
    params = {"max_new_tokens": 48, "temperature": 1.0, "ignore_eos": True}
    with httpx.Client(timeout=600) as http:  # one prompt a request: the router spreads them
        for i in range(4):
            for p in ROLLOUT_PROMPTS:
                body = {"text": p, "sampling_params": {**params, "sampling_seed": i}}
                assert http.post(f"{router_url}/generate", json=body).status_code == 200
    link = FleetLink(router_url, refresh_s=0.0)
    cfg = OnlineConfig(
        state_dir=str(tmp_path), init=str(drafter_dir), row_len=64, accum=2, lr=3e-3,
        min_train_tokens=256, pull_every_s=0.0, eval_every=10, eval_rows=4,
        checkpoint_every=10, report_every_s=0.0, store=StoreConfig(heldout_every=4),
    )
    trainer = OnlineTrainer(cfg, link)
    assert trainer.tick() == "pulled"
    pulled = link.cursor
    assert set(pulled) == {r.base_url for r in replicas} and min(pulled.values()) > 0
    assert trainer.cursor == len(ROLLOUT_PROMPTS) * 4  # every sample, from whichever replica
    assert link.lender in pulled  # an idle replica lends its cores

    did = [trainer.tick() for _ in range(400) if trainer.published_version == 0]
    assert "published" in did, trainer.verdict
    published = str(tmp_path / "published" / "v1")
    assert [drafter_of(r.base_url) for r in replicas] == [(1, published)] * 2

    # A replica the router adds later is brought to the published drafter.
    late = replica(tiny_model_dir, drafter_dir)
    stopped = False
    try:
        api = RouterApi(router_url)
        api.add(late.base_url)
        api.wait_healthy([late.base_url], timeout=60)
        assert drafter_of(late.base_url) != (1, published)
        trainer.tick()
        assert drafter_of(late.base_url) == (1, published)
        # It leaves again: the trainer goes on without it.
        late.stop()
        stopped = True
        wait_for(lambda: (trainer.tick(), late.base_url not in link.links)[1], timeout=120,
                 interval=0.2)
        assert sorted(link.links) == sorted(r.base_url for r in replicas)
        assert late.base_url in link.cursor  # kept, should it come back
    finally:
        if not stopped:
            late.stop()
