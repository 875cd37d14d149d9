"""vLLM's own offline ``LLM.generate``, greedy, for comparison with ``--backend vllm``: run as
``python -m tests.vllm_offline JOB.json`` (a process of its own: vLLM sets environment
variables and start methods in the process that builds it). JOB: {"models": [dir, ...],
"prompts": [[ids]], "max_tokens": [n], "dtype", "max_model_len", "max_num_seqs",
"kv_bytes"}; prints {"dir": [[ids], ...]} as JSON on its last line."""

from __future__ import annotations

import json
import sys


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    from tlt_serve.backends.vllm.args import BLOCK_SIZE, set_cpu_env

    set_cpu_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import tokens_input

    out = {}
    for model in job["models"]:
        llm = LLM(model=model, dtype=job["dtype"], max_model_len=job["max_model_len"],
                  max_num_seqs=job["max_num_seqs"], enforce_eager=True, seed=0,
                  block_size=BLOCK_SIZE, kv_cache_memory_bytes=job["kv_bytes"])
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in job["max_tokens"]]
        results = llm.generate([tokens_input(p) for p in job["prompts"]], params)
        out[model] = [list(r.outputs[0].token_ids) for r in results]
        llm.llm_engine.engine_core.shutdown()
        del llm
    print(json.dumps(out))


if __name__ == "__main__":
    main()
