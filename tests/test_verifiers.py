"""A verifiers environment (prime-rl's) rolled out against the server by verifiers' own chat
harness: a multi-turn task with a tool served over MCP. The served model is a tiny one
trained to call ``get_weather`` on verifiers' exact request and to answer once the tool's
result comes back (``tests/tool_model.py``); verifiers streams every turn with the tools, sends
the call and the tool's result back, and scores the episode; then the same through prime-rl's
rollout client (verifiers' ``TrainClient``: token ids rendered client-side, sent to
``/inference/v1/generate``).

verifiers pins packages this environment holds at other versions (openai < 3, mcp 2.0), so it
lives in a virtualenv of its own, ``.venv-verifiers`` (``bash scripts/install.sh
--verifiers``), and its harness fetches its own dependencies with uv on the first run.
Skipped without that virtualenv, except where ``TLT_REQUIRE_VERIFIERS=1`` (CI) makes its
absence a failure."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Served, serve, skip_unless_required
from tests.tool_model import (
    VERIFIERS_ANSWER,
    VERIFIERS_QUESTION,
    make_tool_model,
    verifiers_lessons,
)

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-verifiers"
if not (VENV / "bin" / "python").exists():
    skip_unless_required(f"verifiers' virtualenv {VENV} is missing (bash scripts/install.sh "
                         "--verifiers)", "TLT_REQUIRE_VERIFIERS")


@pytest.fixture(scope="module")
def tool_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = make_tool_model(tmp_path_factory.mktemp("vf") / "hermes", "hermes",
                            verifiers_lessons("hermes"))
    s = serve(model, max_model_len=1024)
    yield s
    s.stop()


@pytest.mark.parametrize("client", ["eval", "train"])
def test_a_verifiers_tool_task_rolls_out(tool_served: Served, tmp_path: Path,
                                         client: str) -> None:
    """``eval``: verifiers' chat client streaming chat completions; ``train``: prime-rl's
    rollout client rendering token ids itself through ``/inference/v1/generate``, whose trace
    keeps every sampled token's logprob."""
    env = {**os.environ, "TLT_VERIFIERS_QUESTION": VERIFIERS_QUESTION,
           "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}",  # its uv
           "HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(
        [str(VENV / "bin" / "python"), str(REPO / "tests" / "verifiers_task.py"),
         tool_served.base_url + "/v1", str(tool_served.model_dir), str(tmp_path), client],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    (episode,) = json.loads((tmp_path / "result.json").read_text())
    assert episode["errors"] == [] and episode["ok"], episode
    roles = [m["role"] for m in episode["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"], episode
    call = episode["messages"][1]["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in call] == \
        [("get_weather", {"city": "Paris"})]
    assert "sunny" in episode["messages"][2]["content"]  # verifiers' tool ran
    assert episode["messages"][3]["content"] == VERIFIERS_ANSWER
    assert episode["reward"] == 1.0
    if client == "train":  # both turns' sampled tokens, each with the target's logprob
        sampled = [lp for lp, s in zip(episode["logprobs"], episode["sampled_mask"],
                                       strict=True) if s]
        assert sum(episode["sampled_mask"]) > 16 and len(sampled) == sum(
            episode["sampled_mask"])
        assert all(lp <= 0.0 for lp in sampled) and any(lp < 0.0 for lp in sampled)
