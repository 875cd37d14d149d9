"""TRL 1.16's own ``VLLMClient`` against a running server, in a process of its own (the client
imports vLLM, which changes the importing process's environment): the calls TRL's GRPO and
distillation trainers make in vLLM server mode, their results written as JSON.

    python -m tests.trl_driver URL SPEC.json OUT.json

SPEC: ``prompts`` (token ids), ``sequences`` + ``prompt_lengths`` (to score), ``messages``."""

from __future__ import annotations

import json
import sys


def main(url: str, spec_path: str, out_path: str) -> int:
    from trl.generation.vllm_client import VLLMClient

    with open(spec_path) as f:
        spec = json.load(f)
    client = VLLMClient(base_url=url, connection_timeout=60)
    out = {
        "world_size": client.get_world_size(),
        "generate": client.generate(spec["prompts"], n=2, temperature=0.0, max_tokens=6,
                                    logprobs=2),
        "scored": client.get_sequence_logprobs(spec["sequences"], spec["prompt_lengths"],
                                               top_logprobs=3),
        # its default: the top 100 (a server started with --max-logprobs 100 or more)
        "scored_default": client.get_sequence_logprobs(spec["sequences"],
                                                       spec["prompt_lengths"]),
        "chat": client.chat([spec["messages"]], max_tokens=4, temperature=0.0, logprobs=0),
    }
    client.reset_prefix_cache()
    # GRPO's importance-sampling check, then the weight path: refused up front by name
    out["logprobs_mode"] = client.get_server_info()["model_config"]["logprobs_mode"]
    try:
        client.init_communicator(device="cpu")
        out["init_communicator"] = "joined"
    except RuntimeError as err:
        out["init_communicator"] = str(err)
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
