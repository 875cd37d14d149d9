"""AReaL's own rollout client (areal 1.0.4, ``RemoteSGLangEngine``: generation, weight updates,
``compute_logp``) driven against tlt-serve,
in a process of its own: importing areal sets ``OPENAI_API_KEY``/``OPENAI_BASE_URL`` and
replaces the logging module's root logger (``disable_existing_loggers``) for the whole
process, which must not leak into the other test modules. ``tests/test_areal.py`` runs it.

    python -m tests.areal_driver SPEC.json OUT.json

SPEC: ``gen_addrs`` (host:port the engine generates through: a replica or a router),
``replicas`` (host:port of every replica: weight updates go to each, as AReaL sends them),
``prompts`` (token id lists), ``max_new_tokens``, ``long_prompt``/``long_new_tokens`` (the
request caught in flight by the update), ``new_checkpoint`` (the "trainer's" new weights),
``workdir``, ``vllm_client`` (also run AReaL's vLLM client, ``RemotevLLMEngine``: generation
through ``/v1/completions``, ``compute_logp`` through ``echo`` + ``prompt_logprobs``). OUT:
what AReaL built and got back (see ``main``). Exit code 3: areal (or a
package it imports) is missing.

The weight update is the sequence AReaL 1.0.4's trainer runs (``PPOTrainer``'s step, then
``FSDPEngine._update_weights_from_disk`` on rank 0): ``rollout.pause()``;
``pause_generation()``; ``update_weights_from_disk(meta)`` (which waits on the name_resolve
key the trainer writes once its checkpoint is saved); save; ``name_resolve.add``; wait;
``continue_generation()``; ``set_version``; ``rollout.resume()``. Only the FSDP model and its
``save`` cannot run here (no torch.distributed group, no GPU): "saving" is a copy of a ready
checkpoint into ``meta.path``, which AReaL deletes after the load
(``clear_checkpoint_after_load``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

EXPERIMENT, TRIAL = "tlt-serve", "areal-compat"


def main(spec_path: str, out_path: str) -> int:
    try:
        from areal.api.cli_args import (
            GenerationHyperparameters,
            InferenceEngineConfig,
            NameResolveConfig,
        )
        from areal.api.io_struct import ModelRequest, WeightUpdateMeta
        from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
        from areal.engine.vllm_remote import RemotevLLMEngine
        from areal.utils import name_resolve, names
    except ImportError as err:
        print(f"areal is not importable: {err!r}", file=sys.stderr)
        return 3

    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["workdir"])
    name_resolve.reconfigure(
        NameResolveConfig(type="nfs", nfs_record_root=str(work / "name_resolve"))
    )

    def engine(addrs: list[str], kind: str = "sglang") -> Any:
        config = InferenceEngineConfig(
            backend=f"{kind}:d1", experiment_name=EXPERIMENT, trial_name=TRIAL,
            setup_timeout=60, request_timeout=120, request_retries=2,
        )
        eng = (RemoteSGLangEngine if kind == "sglang" else RemotevLLMEngine)(config)
        eng.initialize(addr=addrs)
        return eng

    def request(prompt: list[int], n: int, greedy: bool, ignore_eos: bool = False) -> Any:
        # max_new_tokens defaults to 16384 in GenerationHyperparameters: always set it.
        g = GenerationHyperparameters(max_new_tokens=n, greedy=greedy, ignore_eos=ignore_eos)
        return ModelRequest(input_ids=list(prompt), gconfig=g)

    def generate(eng: Any, req: Any) -> dict[str, Any]:
        r = asyncio.run(eng.agenerate(req))
        return {"tokens": r.output_tokens, "logprobs": r.output_logprobs,
                "versions": r.output_versions, "stop": r.stop_reason,
                "input": r.input_tokens}

    # The engine that generates (through a router, or the one replica) and the one that
    # updates weights: AReaL sends every control call to each of its addresses, and
    # sglang-router 0.3.2 answers 404 to /pause_generation, /continue_generation and
    # /update_weights_from_disk, so behind a router these go to the replicas themselves.
    gen = engine(spec["gen_addrs"])
    upd = gen if spec["replicas"] == spec["gen_addrs"] else engine(spec["replicas"])
    engines = [gen] if upd is gen else [gen, upd]
    out: dict[str, Any] = {}
    try:
        n = spec["max_new_tokens"]
        out["payload"] = SGLangBackend().build_generation_request(
            request(spec["prompts"][0], n, greedy=True), with_lora=False, version=0
        ).payload
        out["before"] = [generate(gen, request(p, n, greedy=True)) for p in spec["prompts"]]
        out["sampled"] = generate(gen, request(spec["prompts"][0], n, greedy=False))

        meta = WeightUpdateMeta.from_disk(EXPERIMENT, TRIAL, str(work / "fileroot"))
        meta = meta.with_version(1)  # .../weight_update_v1, as the trainer's step 0 → 1
        out["update_payload"] = SGLangBackend().build_disk_weight_update_requests(
            meta).requests[0].payload
        with ThreadPoolExecutor(1) as pool:
            long_req = request(spec["long_prompt"], spec["long_new_tokens"], greedy=True,
                               ignore_eos=True)
            in_flight = hold_in_flight(spec["replicas"],
                                       lambda: pool.submit(generate, gen, long_req))
            gen.pause()  # rollout.pause(): an interrupted request waits before resending
            upd.pause_generation()  # aborts the request held in flight: partial output
            fut = upd.update_weights_from_disk(meta)
            shutil.copytree(spec["new_checkpoint"], meta.path)  # the trainer's save
            key = names.update_weights_from_disk(EXPERIMENT, TRIAL, upd.get_version())
            name_resolve.add(key, str(datetime.now().timestamp()), keepalive_ttl=120)
            fut.result(timeout=120)
            upd.continue_generation()
            for eng in engines:
                eng.set_version(1)
            gen.resume()
            out["long"] = in_flight.result(timeout=120)
        out["update_path"] = meta.path
        # AReaL removes the checkpoint in a done-callback that may run just after result().
        deadline = time.monotonic() + 10
        while Path(meta.path).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        out["update_path_exists"] = Path(meta.path).exists()
        out["after"] = [generate(gen, request(p, n, greedy=True)) for p in spec["prompts"]]
        out["recomputed"] = recompute(gen, spec["prompts"], out["after"])
        if spec.get("vllm_client"):  # AReaL's vLLM client against the same server
            vllm = engine(spec["gen_addrs"], "vllm")
            engines.append(vllm)
            out["vllm_after"] = [generate(vllm, request(p, n, greedy=True))
                                 for p in spec["prompts"]]
            out["vllm_recomputed"] = recompute(vllm, spec["prompts"], out["vllm_after"])
    finally:
        for eng in engines:
            eng.destroy()
    Path(out_path).write_text(json.dumps(out))
    return 0


def recompute(eng: Any, prompts: list[list[int]], samples: list[dict[str, Any]]
              ) -> list[list[float]]:
    """AReaL's ``compute_logp`` (the trainer's proximal / reference logprobs) over the
    rollout it just generated: each sequence prompt + completion, the completion masked in,
    one padded batch; the completion's logprobs come back per sequence."""
    import torch

    seqs = [p + s["tokens"] for p, s in zip(prompts, samples, strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (p, seq) in enumerate(zip(prompts, seqs, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        mask[i, len(p) : len(seq)] = 1
    (logp,) = eng.compute_logp([{"input_ids": ids, "loss_mask": mask, "attention_mask": attn}])
    return [logp[i, mask[i].bool()].tolist() for i in range(len(seqs))]


def hold_in_flight(replicas: list[str], start: Any) -> Future[Any]:
    """Start the long request and freeze it mid-generation (some tokens out, not finished).

    Test scaffolding, not AReaL: the tiny model writes 200 tokens in ~0.2 s, too fast to
    catch by timing, so the replicas are paused in place (``mode: in_place`` keeps running
    requests) and resumed in short steps until one is caught running with tokens out; one
    that finished first is sent again. AReaL's own ``pause_generation`` (mode abort) then
    aborts it, as it would a rollout running when a training step ends."""
    http = httpx.Client(timeout=30)

    def post_all(path: str, **body: Any) -> None:
        for r in replicas:
            http.post(f"http://{r}{path}", json=body).raise_for_status()

    def counts() -> tuple[int, int]:  # (running, tokens generated so far), all replicas
        stats = [http.get(f"http://{r}/get_server_info").json()["stats"] for r in replicas]
        return sum(s["running"] for s in stats), sum(s["generated_tokens"] for s in stats)

    try:
        for _ in range(20):
            _, base = counts()
            fut = start()
            while not fut.done():
                post_all("/pause_generation", mode="in_place")
                running, generated = counts()
                if running and generated > base:
                    return fut  # left paused; AReaL's pause_generation aborts it
                post_all("/continue_generation")
                time.sleep(0.003)
            post_all("/continue_generation")
            fut.result()
        raise RuntimeError("never caught the long request in flight")
    finally:
        http.close()

if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
