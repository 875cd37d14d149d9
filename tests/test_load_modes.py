"""The load benchmark's three modes (benchmarks/common/load.py, ``benchmarks.rollout load``) against
a real server on the tiny model, in both dialects: every request is sent and counted, and each
mode reports its figures (makespan and the small-batch phase; latency percentiles; one row per
concurrency)."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from benchmarks.common import load
from benchmarks.common.load import Endpoint
from benchmarks.rollout import run_mode
from tests.harness import Served

LENGTHS = [3, 12, 5, 20, 8, 4]
REQS = [
    ([5 + i, 6, 7, 8], {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    for i, n in enumerate(LENGTHS)
]


def endpoint(served: Served, dialect: str) -> Endpoint:
    model = httpx.get(f"{served.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    return Endpoint(served.base_url, dialect, model)


def complete(stats: dict) -> None:
    assert stats["requests"] == len(REQS) and stats["errors"] == 0
    assert stats["tokens"] == sum(LENGTHS)
    for key in ("ttft", "tpot", "e2e"):
        assert stats[key]["p50"] is not None and stats[key]["p50"] <= stats[key]["p99"]


@pytest.mark.parametrize("dialect", ["generate", "openai"])
def test_rollout_mode_counts_every_token_and_the_small_batch_phase(served, dialect) -> None:
    stats = asyncio.run(load.rollout(endpoint(served, dialect), REQS, "t", spec_max_batch=2,
                                     bin_s=0.5))
    complete(stats)
    assert stats["lengths"] == sorted(LENGTHS)
    assert 0 < stats["small_batch_s"] <= stats["makespan_s"]
    assert sum(stats["timeline"]["tok_s"]) * 0.5 == pytest.approx(sum(LENGTHS))


@pytest.mark.parametrize("dialect", ["generate", "openai"])
def test_poisson_and_sweep_modes_report_latency_per_setting(served, dialect) -> None:
    ep = endpoint(served, dialect)
    poisson = asyncio.run(load.poisson(ep, REQS, "t", rate=40.0, seed=0))
    assert poisson["rate"] == 40.0
    complete(poisson)
    sweep = run_mode(argparse.Namespace(mode="sweep", concurrency=[1, 3]), ep, REQS, "t")
    assert list(sweep) == ["1", "3"]
    for stats in sweep.values():
        complete(stats)
