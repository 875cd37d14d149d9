"""The load benchmark's three modes (benchmarks/rollout_load.py) against a real server on the
tiny model, in both dialects: every request is sent and counted, and each mode reports its
figures (makespan and the small-batch phase; latency percentiles; one row per concurrency)."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from benchmarks.rollout_load import poisson_mode, rollout_mode, sweep_mode
from tests.test_server_harness import Served

LENGTHS = [3, 12, 5, 20, 8, 4]
REQS = [
    ([5 + i, 6, 7, 8], {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    for i, n in enumerate(LENGTHS)
]


def args(served: Served, dialect: str) -> argparse.Namespace:
    model = httpx.get(f"{served.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    return argparse.Namespace(
        dialect=dialect, served_model=model, seed=0, rate=40.0, concurrency=[1, 3], bin_s=0.5,
        spec_max_batch=2,
    )


def complete(stats: dict) -> None:
    assert stats["requests"] == len(REQS) and stats["errors"] == 0
    assert stats["tokens"] == sum(LENGTHS)
    for key in ("ttft", "tpot", "e2e"):
        assert stats[key]["p50"] is not None and stats[key]["p50"] <= stats[key]["p99"]


@pytest.mark.parametrize("dialect", ["generate", "openai"])
def test_rollout_mode_counts_every_token_and_the_small_batch_phase(served, dialect) -> None:
    stats = asyncio.run(rollout_mode(served.base_url, args(served, dialect), REQS, "t"))
    complete(stats)
    assert stats["lengths"] == sorted(LENGTHS)
    assert 0 < stats["small_batch_s"] <= stats["makespan_s"]
    assert sum(stats["timeline"]["tok_s"]) * 0.5 == pytest.approx(sum(LENGTHS))


@pytest.mark.parametrize("dialect", ["generate", "openai"])
def test_poisson_and_sweep_modes_report_latency_per_setting(served, dialect) -> None:
    a = args(served, dialect)
    poisson = asyncio.run(poisson_mode(served.base_url, a, REQS, "t"))
    assert poisson["rate"] == a.rate
    complete(poisson)
    sweep = asyncio.run(sweep_mode(served.base_url, a, REQS, "t"))
    assert list(sweep) == ["1", "3"]
    for stats in sweep.values():
        complete(stats)
