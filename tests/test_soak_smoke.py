"""A short run of the soak test (benchmarks/stress/soak.py) against a tiny-model server.

24 clients on 8 KV rows with a 4-request queue: requests wait, overflow (503 + Retry-After,
retried), get disconnected and aborted at random points, for a few seconds; requests still
open shortly after the load stops are aborted. Every response must be accounted for and the
server must drain to empty.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from benchmarks.common.results import write
from benchmarks.stress.soak import SoakConfig, plot, run_soak, summarize
from tests.harness import serve
from tlt_serve.config import SchedulerConfig

CONFIG = SoakConfig(
    duration_s=8.0, concurrency=24, disconnect_frac=0.25, abort_frac=0.25, min_new_tokens=4,
    max_new_tokens=24, seed=1, sample_s=1.0, drain_timeout_s=3.0, end_abort_timeout_s=20.0,
    settle_timeout_s=15.0, stall_timeout_s=30.0, progress=False,
)


def test_soak_smoke(tiny_model_dir: Path, tmp_path: Path) -> None:
    served = serve(tiny_model_dir, max_num_seqs=8, scheduler=SchedulerConfig(max_waiting=4),
                   num_threads=1)  # a tiny model: one thread, no fight over a shared machine
    try:
        result = asyncio.run(run_soak(served.base_url, CONFIG, os.getpid()))
    finally:
        served.stop()
    summary = summarize(result)
    write(summary, tmp_path / "soak.json", plot)
    c = summary["counts"]
    assert summary["failures"] == [], (summary["failures"], summary["problems"])
    assert c["lost"] == c["duplicates"] == c["errors"] == 0
    assert summary["kv_end"]["empty"] and summary["kv_end"]["kv_rows_used"] == 0
    assert summary["accounting"]["match"]
    # Every path was taken: normal finishes, aborts, disconnects, queue-full retries.
    assert c["completed"] > 0 and c["aborted"] > 0 and c["disconnected"] > 0
    assert c["retries_503"] > 0
    assert c["finished"] == c["sent"]
    assert summary["memory"]["slope_whole_mb_per_min"] is not None
    assert (tmp_path / "soak.json").exists() and (tmp_path / "soak.png").exists()
