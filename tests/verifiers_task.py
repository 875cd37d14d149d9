"""A verifiers (0.4) tool task rolled out against a running server, in verifiers' own
virtualenv (``bash scripts/install.sh --verifiers``): prime-rl's environments, as they run.

    TLT_VERIFIERS_QUESTION=... .venv-verifiers/bin/python tests/verifiers_task.py BASE_URL \
        MODEL OUT_DIR [eval|train]

One task asks the question; the ``get_weather`` tool is served by verifiers over MCP in a
subprocess (this module again, with ``VF_CONFIG`` set); verifiers' own chat harness runs the
turns with the tools until the model stops calling them; the reward is 1 when a tool result
reached the model. ``eval`` (the default) streams chat completions; ``train`` is prime-rl's
rollout client: verifiers' ``TrainClient`` renders each turn to token ids itself (the
model's chat template, Qwen3's ``<tool_call>`` parser) and calls ``/inference/v1/generate``
with prime-rl's train sampling (its ``extra_body`` defaults and a ``cache_salt``, no
``max_tokens``), and the trace keeps the sampled token ids and logprobs. Each episode's
messages, reward, errors and tokens are written to ``OUT_DIR/result.json``. verifiers finds
the taskset by this module's name (``__all__``). This file imports nothing of tlt-serve: it
runs where verifiers is installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.types import content_text


class WeatherTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # offered as plain `get_weather`

    @vf.tool
    def get_weather(self, city: str) -> str:
        """Get the current weather for a city."""
        return f"The weather in {city} is sunny, 22C."


class WeatherTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class WeatherTask(vf.Task[vf.TaskData, vf.State, WeatherTaskConfig]):
    @classmethod
    def toolsets(cls, config: WeatherTaskConfig) -> list[vf.Toolset]:
        return [WeatherTools(config.tools)]

    @vf.reward(weight=1.0)
    async def used_the_tool(self, trace: vf.Trace) -> float:
        return float(any("sunny" in content_text(m.content) for m in trace.tool_messages))


class WeatherTasksetConfig(vf.TasksetConfig):
    task: WeatherTaskConfig = WeatherTaskConfig()


class WeatherTaskset(vf.Taskset[WeatherTask, WeatherTasksetConfig]):
    def load(self) -> Any:
        question = os.environ["TLT_VERIFIERS_QUESTION"]  # what the served model learned
        yield WeatherTask(vf.TaskData(prompt=question), self.config.task)


__all__ = ["WeatherTaskset"]


def _message(m: Any) -> dict[str, Any]:
    calls = [{"name": c.name, "arguments": c.arguments} for c in getattr(m, "tool_calls", None)
             or []]
    return {"role": m.role, "content": content_text(m.content) if m.content else "",
            "tool_calls": calls}


def main(base_url: str, model: str, out_dir: Path, client_type: str = "eval") -> None:
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("TLT_VERIFIERS_KEY", "none")
    config = EvalConfig(
        env={"taskset": {"id": "verifiers_task"},
             "agent": {"harness": {"id": "null"},  # verifiers' chat loop with MCP tools
                       "runtime": {"type": "subprocess"},  # here, not in a remote sandbox
                       "max_turns": 4, "timeout": {"rollout": 300, "scoring": 60}}},
        model=model,
        client=_client(client_type, base_url, model),
        sampling=_sampling(client_type),
        select={"limit": 1}, num_rollouts=1, max_concurrent=1,
        rich=None, push=False, output_dir=str(out_dir / "outputs"),
    )
    episodes = asyncio.run(run_eval(config))
    result = [
        {"ok": t.ok, "reward": t.reward, "stop": str(t.stop_condition),
         "errors": [f"{e.type}: {e.message}" for e in t.errors],
         "messages": [_message(m) for m in t.messages],
         **_tokens(t)}
        for ep in episodes for t in ep.traces
    ]
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))


def _tokens(trace: Any) -> dict[str, list[Any]]:
    """The training view of the trace's last branch: token ids, which were sampled, their
    logprobs (0 where not sampled)."""
    if not trace.branches:
        return {"token_ids": [], "sampled_mask": [], "logprobs": []}
    branch = trace.branches[-1]
    return {"token_ids": list(branch.token_ids), "sampled_mask": list(branch.sampled_mask),
            "logprobs": list(branch.logprobs)}


def _client(client_type: str, base_url: str, model: str) -> dict[str, Any]:
    common = {"type": client_type, "base_url": base_url, "api_key_var": "TLT_VERIFIERS_KEY"}
    if client_type == "eval":
        return common
    return {**common, "renderer_model_name": model,
            "renderer": {"name": "default", "tool_parser": "qwen3"}}


def _sampling(client_type: str) -> dict[str, Any]:
    if client_type == "eval":
        return {"temperature": 0.0, "max_tokens": 96}
    # prime-rl's policy rollouts (TrainSamplingConfig, the orchestrator's defaults)
    return {"temperature": 0.0, "top_p": 1.0, "logprobs": True,
            "extra_body": {"top_k": -1, "min_p": 0.0, "return_token_ids": True,
                           "cache_salt": "policy-0"}}


if __name__ == "__main__":
    if "VF_CONFIG" in os.environ:  # verifiers starting the tool server
        WeatherTools.run()
    else:
        main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), *sys.argv[4:])
