"""Entry point of the vLLM engine process (``--backend vllm``).

It checks the installed vLLM (``compat.py``), builds ``AsyncLLM`` (which starts vLLM's
engine-core and worker processes, so this process is not a daemon: ``server/bridge.py``),
checks the model runner our worker extension reaches into, reports ``Ready`` with the same
``EngineInfo`` the native engine gives, and runs ``VllmLoop`` until told to stop. vLLM's
children are stopped with it; a start-up failure (a model or drafter vLLM cannot load)
reaches the front end as ``Failed`` naming why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import traceback
from pathlib import Path
from typing import Any

from tlt_serve.backends.common.descriptors import close_inherited_on_exec
from tlt_serve.backends.vllm.args import (
    VllmSpec,
    engine_args,
    resolve_spec,
    set_cpu_env,
    set_gpu_env,
)
from tlt_serve.config import EngineConfig
from tlt_serve.contract.controls import ControlError
from tlt_serve.contract.messages import Failed, Fatal, Ready
from tlt_serve.contract.reports import EngineInfo, SpecInfo
from tlt_serve.devices import Gpu, gpus
from tlt_serve.speculative.checkpoint import read_drafter_config

log = logging.getLogger("tlt_serve.vllm")


def run_vllm(config: EngineConfig, conn: Any, log_level: str = "info") -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides how we stop
    close_inherited_on_exec()  # our exit must close the front end's pipe and sentinel
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    scratch = Path(tempfile.mkdtemp(prefix="tlt-vllm-"))
    llm = None
    try:
        try:
            llm, info, spec, stats, device = _start(config, scratch)
        except Exception as err:  # any start-up failure must reach the front end
            log.exception("vLLM engine start-up failed")
            conn.send(Failed(f"backend vllm: {type(err).__name__}: {err}"))
            return
        asyncio.run(_serve(llm, conn, info, spec, stats, scratch, config, device))
    except Exception:
        log.exception("vLLM engine loop crashed")
        with contextlib.suppress(OSError):
            conn.send(Fatal(traceback.format_exc()))
        raise
    finally:
        if llm is not None:
            llm.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)


def _start(
    config: EngineConfig, scratch: Path
) -> tuple[Any, EngineInfo, VllmSpec, Any, str]:
    from tlt_serve.backends.vllm.stat_logger import LoopStats
    from tlt_serve.models.provision import resolve_model_path
    from tlt_serve.models.tokenizer import load_tokenizer

    model_dir = resolve_model_path(config.model.model)
    import vllm
    from vllm.platforms import current_platform

    from tlt_serve.backends.vllm.compat import check_vllm

    check_vllm(vllm.__version__)  # before anything patches or calls vLLM's internals
    # vLLM's V1 model runner on every platform: our worker extension reaches the drafter
    # where it keeps it (the V2 runner, CUDA's default, keeps it elsewhere).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    gpu = platform_gpu(current_platform.is_cuda())
    if gpu is None:
        set_cpu_env()
    else:
        set_gpu_env()
    spec = resolve_spec(config.spec, scratch)
    from vllm.config import CompilationMode
    from vllm.v1.engine.async_llm import AsyncLLM

    stats = LoopStats()
    llm = AsyncLLM.from_engine_args(
        engine_args(model_dir, config, spec, gpu), stat_loggers=[stats.logger_factory()])
    hf = json.loads((model_dir / "config.json").read_text())
    k = config.spec.num_draft_tokens if spec.proposer != "none" else 0
    info = EngineInfo(
        model=config.model.model,
        model_path=str(model_dir),
        dtype=config.model.dtype,
        vocab_size=int(hf["vocab_size"]),
        max_model_len=int(llm.model_config.max_model_len),
        max_num_seqs=config.cache.max_num_seqs,
        max_waiting=config.scheduler.max_waiting,
        eos_ids=tuple(sorted(load_tokenizer(model_dir).eos_ids)),
        weight_version="0",
        max_logprobs=config.model.max_logprobs,
        compiled=llm.vllm_config.compilation_config.mode != CompilationMode.NONE,
        spec=SpecInfo(
            method=config.spec.method,
            proposer=spec.proposer,
            num_draft_tokens=k,
            # vLLM's suffix decoding speculates at every batch size (resolve_spec)
            max_batch=(config.cache.max_num_seqs if spec.proposer == "suffix"
                       else config.spec.max_batch) if k else 0,
            drafter=config.spec.drafter if spec.proposer == "drafter" else None,
            strategies=(f"{spec.proposer}:{k}",) if k else (),
        ),
    )
    return llm, info, spec, stats, "cpu" if gpu is None else "cuda"


def platform_gpu(cuda: bool) -> Gpu | None:
    """The GPU vLLM runs on: None for its CPU build, else the first one NVML sees. A CUDA
    build with no GPU visible is refused here: configured as a CPU engine it would fail
    later, inside vLLM, without saying why."""
    if not cuda:
        return None
    found = gpus()
    if not found:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        raise RuntimeError(f"vLLM's platform is CUDA but NVML finds no GPU this process may "
                           f"use{shown}: make one visible (CUDA_VISIBLE_DEVICES by index or "
                           "full GPU UUID), or run vLLM's CPU build")
    return found[0]


async def _serve(
    llm: Any, conn: Any, info: EngineInfo, spec: VllmSpec, stats: Any, scratch: Path,
    config: EngineConfig, device: str,
) -> None:
    from tlt_serve.backends.vllm.compat import VllmMismatch, check_runner
    from tlt_serve.backends.vllm.controls import VllmControls
    from tlt_serve.backends.vllm.drafter_swap import VllmDrafter
    from tlt_serve.backends.vllm.loop import VllmLoop
    from tlt_serve.backends.vllm.samples import VllmCapture
    from tlt_serve.backends.vllm.state import VllmState, WorkerRpc
    from tlt_serve.backends.vllm.weights import VllmWeights

    state = VllmState(info, info.weight_version)
    if spec.proposer == "drafter":
        state.drafter_version = read_drafter_config(config.spec.drafter or "")[2].version
    loop = VllmLoop(llm, conn, state, stats)
    rpc = WorkerRpc(llm, loop.die)
    try:  # what the worker extension reaches in vLLM's model runner, before serving
        check_runner(await rpc("tlt_probe"), spec.proposer)
        if config.capture.enabled:
            loop.capture = VllmCapture(state, rpc, scratch, config.capture, config.seed)
            await loop.capture.start()
    except (VllmMismatch, ControlError, RuntimeError) as err:
        log.error("vLLM engine start-up failed: %s", err)
        conn.send(Failed(f"backend vllm: {type(err).__name__}: {err}"))
        return
    conn.send(Ready(info))
    lock = asyncio.Lock()  # one weight / drafter change at a time
    weights = VllmWeights(state, rpc, lock, loop.abort_every_sample, scratch, device)
    drafter = VllmDrafter(state, rpc, lock, spec, scratch, loop.capture, stats,
                          config.spec.drafter)
    loop.controls = VllmControls(llm, state, stats, loop.capture, weights, drafter,
                                 loop.abort_every_sample)
    await loop.run()
