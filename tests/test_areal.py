"""AReaL's own client code (areal 1.0.4, ``areal.engine.sglang_remote.RemoteSGLangEngine``)
against one tlt-serve replica and against sglang-router in front of two: ``agenerate`` with
logprobs, then AReaL's disk weight update (``update_weights_from_disk``) with a rollout
caught in flight, after which every replica reports the new version and serves the new
weights, and ``compute_logp`` recomputes the new rollout's logprobs. AReaL runs in a
process of its own (``tests/areal_driver.py`` says why and what it does); this module checks
what it got against servers started here.

Needs areal (``bash scripts/install.sh --areal``) and, for the fleet, sglang-router; skipped
without them, except where ``TLT_REQUIRE_AREAL=1`` makes the absence of either a failure.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import (
    Served,
    free_run,
    need,
    need_router,
    read_line,
    serve,
    skip_unless_required,
    tiny_flags,
)

AREAL = "TLT_REQUIRE_AREAL"
# Not imported here: importing areal changes this process's environment and logging.
need("areal", "bash scripts/install.sh --areal", AREAL, load=False)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 23, 7], [11, 2, 40, 3, 17], [100, 200, 7, 7, 1, 42]]
NEW_TOKENS = 8
LONG_PROMPT, LONG_TOKENS = [3, 14, 15, 92, 65], 200  # max_model_len is 256 here


@pytest.fixture(scope="module")
def new_weights(tiny_model_factory) -> Path:
    return tiny_model_factory(seed=1)


@pytest.fixture(scope="module")
def new_ref(new_weights: Path) -> Iterator[Served]:
    """A server started on the new weights: what an updated replica must answer."""
    s = serve(new_weights)
    yield s
    s.stop()


@pytest.fixture
def replica(tiny_model_dir: Path) -> Iterator[Served]:
    s = serve(tiny_model_dir)
    yield s
    s.stop()


@pytest.fixture
def fleet(tiny_model_dir: Path) -> Iterator[str]:
    """``tlt-serve fleet --replicas 2``: sglang-router and two replicas; the router's URL."""
    need_router(AREAL)
    port = free_run(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tlt_serve", "fleet", "--replicas", "2", "--port", str(port),
         *tiny_flags(tiny_model_dir)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        read_line(proc, "tlt-serve fleet ready")
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:  # SIGTERM: the fleet stops its router (its own session) too
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def run_areal(gen_addrs: list[str], replicas: list[str], new_weights: Path,
              tmp_path: Path, vllm_client: bool = False) -> dict[str, Any]:
    spec = {"gen_addrs": gen_addrs, "replicas": replicas, "prompts": PROMPTS,
            "max_new_tokens": NEW_TOKENS, "long_prompt": LONG_PROMPT,
            "long_new_tokens": LONG_TOKENS, "new_checkpoint": str(new_weights),
            "workdir": str(tmp_path), "vllm_client": vllm_client}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "tests.areal_driver", str(tmp_path / "spec.json"),
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=400)
    if r.returncode == 3:
        skip_unless_required(f"areal is installed but not importable: {r.stderr.strip()[-300:]}",
                             AREAL)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return json.loads(out.read_text())


def generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(url: str, prompt: list[int], n: int, **sp: Any) -> dict[str, Any]:
    return generate(url, {"input_ids": prompt, "return_logprob": True,
                          "sampling_params": {"max_new_tokens": n, "temperature": 0, **sp}})


def logprobs(out: dict[str, Any]) -> list[float]:
    return [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def check_sample(s: dict[str, Any], n: int, version: int) -> None:
    """A well-formed AReaL ModelResponse: one finite logprob and one version per token."""
    assert 0 < len(s["tokens"]) <= n and s["stop"] in ("stop", "length")
    assert len(s["logprobs"]) == len(s["tokens"]) == len(s["versions"])
    assert all(math.isfinite(lp) and lp <= 0 for lp in s["logprobs"])
    assert s["versions"] == [version] * len(s["tokens"])
    assert s["stop"] == "stop" or len(s["tokens"]) == n


def same(s: dict[str, Any], ref: dict[str, Any]) -> None:
    assert s["tokens"] == ref["output_ids"]
    assert s["logprobs"] == pytest.approx(logprobs(ref), abs=1e-4)


def weight_version(url: str) -> str:
    return httpx.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"]


def check_run(out: dict[str, Any], old_url: str, new_url: str, replicas: list[str],
              new_weights: Path) -> None:
    """``old_url``/``new_url``: servers on the old and the new weights, for reference."""
    # What AReaL sends: its exact /generate body, answered as the plain greedy request.
    payload = out["payload"]
    assert payload["return_logprob"] is True and payload["input_ids"] == PROMPTS[0]
    sp = payload["sampling_params"]
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_k"]) == (NEW_TOKENS, 0.0, 10**8)
    same(out["before"][0], generate(old_url, payload))
    for prompt, s in zip(PROMPTS, out["before"], strict=True):
        check_sample(s, NEW_TOKENS, version=0)
        same(s, greedy(old_url, prompt, NEW_TOKENS))
    check_sample(out["sampled"], NEW_TOKENS, version=0)  # T=1: no seed sent, no reference

    # The update: AReaL's body, each replica on the new version, the checkpoint copy gone.
    assert out["update_payload"] == {"model_path": out["update_path"], "abort_all_requests": True}
    assert out["update_path"].endswith("weight_update_v1") and not out["update_path_exists"]
    assert (new_weights / "config.json").exists()
    assert [weight_version(r) for r in replicas] == ["1"] * len(replicas)

    # The rollout in flight: aborted by AReaL's pause_generation after k tokens (old
    # weights), resent by AReaL after the update with those k tokens appended to its prompt.
    long = out["long"]
    assert len(long["tokens"]) == len(long["logprobs"]) == LONG_TOKENS
    assert long["stop"] == "length" and long["input"] == LONG_PROMPT
    k = long["versions"].count(0)
    assert 0 < k < LONG_TOKENS and long["versions"] == [0] * k + [1] * (LONG_TOKENS - k)
    old = greedy(old_url, LONG_PROMPT, k, ignore_eos=True)
    assert long["tokens"][:k] == old["output_ids"]
    assert long["logprobs"][:k] == pytest.approx(logprobs(old), abs=1e-4)
    new = greedy(new_url, LONG_PROMPT + long["tokens"][:k], LONG_TOKENS - k, ignore_eos=True)
    assert long["tokens"][k:] == new["output_ids"]
    assert long["logprobs"][k:] == pytest.approx(logprobs(new), abs=1e-4)

    # After: the new weights' outputs, through AReaL and from every replica directly.
    for prompt, s in zip(PROMPTS, out["after"], strict=True):
        check_sample(s, NEW_TOKENS, version=1)
        ref = greedy(new_url, prompt, NEW_TOKENS)
        same(s, ref)
        for r in replicas:
            same(s, greedy(r, prompt, NEW_TOKENS))
    assert [s["tokens"] for s in out["after"]] != [s["tokens"] for s in out["before"]]

    # compute_logp over that rollout (prompt logprobs through logprob_start_len): the
    # logprobs the rollout reported (greedy: the raw distribution's), recomputed.
    for s, recomputed in zip(out["after"], out["recomputed"], strict=True):
        assert recomputed == pytest.approx(s["logprobs"], abs=1e-4)


def test_areal_drives_one_replica(replica: Served, served: Served, new_ref: Served,
                                  new_weights: Path, tmp_path: Path) -> None:
    addr = replica.base_url.removeprefix("http://")
    out = run_areal([addr], [addr], new_weights, tmp_path, vllm_client=True)
    check_run(out, served.base_url, new_ref.base_url, [replica.base_url], new_weights)
    # AReaL's vLLM client on the same server: its completions and its compute_logp (echo +
    # prompt_logprobs) give what its SGLang client got.
    for s, v, recomputed in zip(out["after"], out["vllm_after"], out["vllm_recomputed"],
                                strict=True):
        assert v["tokens"] == s["tokens"]  # (versions: that client's own counter, never set)
        assert v["logprobs"] == pytest.approx(s["logprobs"], abs=1e-4)
        assert recomputed == pytest.approx(s["logprobs"], abs=1e-4)


def test_areal_through_sglang_router(fleet: str, served: Served, new_ref: Served,
                                     new_weights: Path, tmp_path: Path) -> None:
    """AReaL generates through the router; its weight updates go to the replicas the
    router lists (sglang-router 0.3.2 answers 404 to the control calls: it forwards only
    /flush_cache to every worker)."""
    from tlt_serve.fleet.router_api import RouterApi

    replicas = sorted(w.url for w in RouterApi(fleet).workers())
    assert len(replicas) == 2
    out = run_areal([fleet.removeprefix("http://")],
                    [r.removeprefix("http://") for r in replicas], new_weights, tmp_path)
    served_by = [httpx.get(f"{r}/get_server_info").json()["stats"]["requests"]
                 for r in replicas]
    assert min(served_by) > 0  # the router spread AReaL's requests over both replicas
    check_run(out, served.base_url, new_ref.base_url, replicas, new_weights)
