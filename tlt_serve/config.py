"""Frozen, layered configuration: Model / Cache / Scheduler / Spec ⊂ Engine ⊂ Server.

Building a config touches no disk and no device; ``validate`` checks ranges and names the
offending field.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from tlt_serve.devices import is_device

DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("native", "vllm")  # tlt_serve/backends
ATTENTION_BACKENDS = ("sdpa", "triton")  # the native engine's captured steps on a GPU
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")  # server/openai/tools.py


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the field name."""


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2-135m"  # named default, local HF dir, .gguf file, or hub repo id
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_model_len: int = 2048  # prompt + output tokens per sequence
    # Every step eagerly: on a GPU no CUDA graphs (the native engine's decode and verify
    # steps; vLLM's own graphs); on a CPU vLLM without torch.compile (the native engine's
    # CPU kernels always run eagerly)
    enforce_eager: bool = False
    # On a GPU, with CUDA graphs: the decoder layers' small ops (norms, rotation, residuals,
    # gate) fused by torch.compile in the steps the graphs replay
    compile: bool = True
    # On a GPU, the attention of those steps: torch's (sdpa) or the own Triton kernel
    # (kernels/decode_attention.py; not yet timed on a GPU)
    attention_backend: str = "sdpa"
    # In bf16 on a CPU (AVX2 or better): every product and attention through the own
    # kernels, whatever the rows of a step, so a token's logits depend on the tokens before
    # it only (not on the batch, prefill or decode, speculation, the prefix cache, scoring)
    batch_invariant: bool = False
    # Top logprobs a request may ask for per position, sampled or prompt (-1: the whole
    # vocabulary), as vLLM's --max-logprobs (TRL's teacher scoring asks 100 by default)
    max_logprobs: int = 20

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        if not is_device(self.device):
            raise ConfigError(f"device: {self.device!r} is not cpu, cuda or cuda:N")
        if self.batch_invariant and (self.device != "cpu" or self.dtype != "bfloat16"):
            raise ConfigError("batch_invariant: the own CPU kernels' mode: needs device cpu "
                              f"and dtype bfloat16, got {self.device} and {self.dtype}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs: must be >= 0, or -1 for the vocabulary, got "
                              f"{self.max_logprobs}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend: {self.attention_backend!r} is not one of "
                              f"{ATTENTION_BACKENDS}")


@dataclass(frozen=True)
class CacheConfig:
    max_num_seqs: int = 64  # KV rows: sequences resident at once
    # On a GPU (backend vllm): the share of its memory the engine takes; None: what it needs
    gpu_memory_utilization: float | None = None
    gpu_reserve_bytes: int = 0  # GPU memory left to others on the engine's GPU (the trainer)
    # Reuse the KV of cached prefixes: the native engine keeps finished sequences' KV in free
    # rows (engine/prefix_cache.py); vLLM's own prefix caching
    prefix_cache: bool = True

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {share}")
        if self.gpu_reserve_bytes < 0:
            raise ConfigError(f"gpu_reserve_bytes: must be >= 0, got {self.gpu_reserve_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 2048  # padded prompt tokens per prefill forward
    max_waiting: int = 4096  # queued requests beyond which new ones are refused
    # running sequences decode in the steps that admit requests (False: a prefill step of
    # its own, the running ones waiting)
    mixed_steps: bool = True

    def validate(self) -> None:
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens: must be >= 1, got {self.max_prefill_tokens}")
        if self.max_waiting < 1:
            raise ConfigError(f"max_waiting: must be >= 1, got {self.max_waiting}")


SPEC_METHODS = ("off", "ngram", "suffix", "drafter", "auto")
MAX_DRAFT_TOKENS = 32
MAX_TREE_TOPK = 8
MAX_BUDGET = 64
# Tree nodes per request the own kernels verify (its ancestors as bits of one int64, the
# root included); larger trees go op by op through torch's attention
INVARIANT_TREE_NODES = 62


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. ``auto``: drafts from rollout history (suffix) and, when one is
    given, the drafter, chosen per step."""

    method: str = "off"  # off | ngram | suffix | drafter | auto
    drafter: str | None = None  # drafter checkpoint directory (see speculative/checkpoint.py)
    num_draft_tokens: int = 4  # chain depth: most tokens drafted per request per step
    # Speculate while at most this many sequences run (the long tail). Forced speculation
    # (benchmarks.decode offline, AMD EPYC Zen 4 with AVX512-BF16, 2026-12-01) is x1.19-1.27
    # of plain at batch 1, x0.81-0.84 at 4 and x0.69-0.77 at 16; up to 8 the bandit may still
    # pick plain decoding per bucket, above it no step pays for its exploration.
    max_batch: int = 8
    tree_topk: int = 1  # > 1: tree drafting (drafter or suffix), children per expanded node
    verify_budget: int = 0  # tree nodes verified per request (0: 2 * num_draft_tokens)
    # Chain depths the auto policy chooses among. Measured here (benchmarks.decode offline,
    # bf16, 2 cores): depth 6 and drafter trees never beat depth 2-4 or plain decoding at any
    # batch size, so they are not default arms: each extra arm costs exploration steps in
    # every bucket. Trees with the own kernels (EPYC Zen 4, 2026-12-01, batch 1, 4 interleaved
    # rounds, warm-up drafter): chain depth 4 x1.06 of plain, trees 4x2/8 x0.65, 5x3/12
    # x0.59, 6x4/16 x0.46: the target's token is seldom in this drafter's top few either, so
    # siblings add little.
    auto_depths: tuple[int, ...] = (2, 4)
    # (depth, top-k, verify budget) of drafter trees the auto policy may also choose among
    auto_trees: tuple[tuple[int, int, int], ...] = ()
    ngram_min_n: int = 2
    ngram_max_n: int = 4
    # Drafts from rollout history (speculative/suffix.py). Under auto, suffix chains of these
    # (most depth, estimated acceptance where the chain is cut) and these (depth, top-k,
    # budget) trees are arms, and so is the combination "suffix+drafter" (suffix drafts where
    # it has one, drafter chains elsewhere) at auto_depths. The suffix index's estimates are
    # calibrated (speculative/suffix.py), so a cut is a price per verified row: a row costs
    # more, relative to what a step yields, at a larger batch; each bucket learns which cut
    # pays. A suffix draft stops below suffix_min_prob x the batch size under a fixed
    # --speculative suffix (a verified row costs ~1 ms in the own kernels at any batch size,
    # benchmarks.kernels rows, while a plain step grows far slower than the batch), and
    # below suffix_min_prob under auto (whose arms' cuts are the price). Most cautious first:
    # the policy tries arms in this order.
    suffix_chains: tuple[tuple[int, float], ...] = ((8, 0.6), (8, 0.3), (8, 0.1))
    suffix_trees: tuple[tuple[int, int, int], ...] = ()
    suffix_min_prob: float = 0.1
    # A drafter chain stops where the product of its drafts' probabilities (the drafter's own
    # softmax) falls below this; 0 drafts every chain to full depth. Lossless: only fewer
    # drafts are verified. Measured (warm-up drafter, bf16, greedy, depth 4, 5 interleaved
    # rounds): 0 / 0.1 / 0.2 drafted 3.9 / 1.7 / 1.4 tokens per verify for the same accepted
    # 0.42 / 0.41 / 0.46, at x0.86 / x1.08 / x1.04 of plain decoding at batch 1 and x0.50 /
    # x0.56 / x0.60 at batch 4; 0.1 beat 0 in all ten rounds. With verify rows in the own
    # kernels (EPYC Zen 4, 2026-12-01, one drafter engine per value, interleaved rounds of 96
    # greedy tokens, two runs): 0.3 over 0.1 +11% / +3% at batch 1 and +28% / +13% at batch
    # 4; 0.4 and 0.5 within noise of 0.3 (one run), 0.7 lower.
    min_draft_confidence: float = 0.3

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative: {self.method!r} is not one of {SPEC_METHODS}")
        if self.method == "drafter" and not self.drafter:
            raise ConfigError("drafter: --speculative drafter needs a drafter checkpoint path")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(
                f"num_draft_tokens: must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}"
            )
        if not 1 <= self.tree_topk <= MAX_TREE_TOPK:
            raise ConfigError(f"tree_topk: must be in [1, {MAX_TREE_TOPK}], got {self.tree_topk}")
        if self.tree_topk > 1 and self.proposer not in ("drafter", "suffix"):
            raise ConfigError("tree_topk: tree drafting needs --speculative drafter or suffix")
        if self.verify_budget and not self.num_draft_tokens <= self.verify_budget <= MAX_BUDGET:
            raise ConfigError(
                f"verify_budget: must be in [num_draft_tokens, {MAX_BUDGET}] "
                f"(or 0 for the default), got {self.verify_budget}"
            )
        for name, trees in (("auto_trees", self.auto_trees), ("suffix_trees", self.suffix_trees)):
            for depth, topk, budget in trees:
                if not (
                    1 <= depth <= MAX_DRAFT_TOKENS
                    and 2 <= topk <= MAX_TREE_TOPK
                    and depth <= budget <= MAX_BUDGET
                ):
                    raise ConfigError(f"{name}: bad (depth, top-k, budget) {(depth, topk, budget)}")
        for name, depths in (("auto_depths", self.auto_depths),
                             ("suffix_chains", tuple(d for d, _ in self.suffix_chains))):
            bad = [d for d in depths if not 1 <= d <= MAX_DRAFT_TOKENS]
            if bad or not depths:
                raise ConfigError(f"{name}: each must be in [1, {MAX_DRAFT_TOKENS}], got {bad}")
        if any(not 0.0 <= p <= 1.0 for _, p in self.suffix_chains):
            raise ConfigError(f"suffix_chains: cuts must be in [0, 1], got {self.suffix_chains}")
        if not 0.0 <= self.suffix_min_prob <= 1.0:
            raise ConfigError(f"suffix_min_prob: must be in [0, 1], got {self.suffix_min_prob}")
        if self.max_batch < 1:
            raise ConfigError(f"spec_max_batch: must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.min_draft_confidence < 1.0:
            raise ConfigError(
                f"min_draft_confidence: must be in [0, 1), got {self.min_draft_confidence}"
            )
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ConfigError(
                f"ngram_min_n: need 1 <= ngram_min_n <= ngram_max_n, "
                f"got {self.ngram_min_n}, {self.ngram_max_n}"
            )

    @property
    def budget(self) -> int:
        """Tree nodes verified per request (tree drafting only)."""
        return self.verify_budget or 2 * self.num_draft_tokens

    @property
    def proposer(self) -> str:
        """none | ngram | suffix | drafter: what ``method`` resolves to (auto: its model)."""
        if self.method == "auto":
            return "drafter" if self.drafter else "suffix"
        return {"off": "none"}.get(self.method, self.method)


@dataclass(frozen=True)
class CaptureConfig:
    """Training samples for the drafter, taken from the serving forwards (``capture.py``)."""

    enabled: bool = False
    max_bytes: int = 512 << 20  # buffer cap (features + tokens); the oldest samples go first
    sample_rate: float = 1.0  # fraction of finished sequences kept (seeded draw per request)
    # Features stay on the model's device (a GPU's memory holds up to max_bytes of them);
    # False: each step copies them to host memory.
    on_device: bool = True

    def validate(self) -> None:
        if self.max_bytes < 1 << 20:
            raise ConfigError(f"capture_max_bytes: must be >= 1 MiB, got {self.max_bytes}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ConfigError(f"capture_sample_rate: must be in (0, 1], got {self.sample_rate}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    seed: int = 0  # seeds the shared generator of requests without their own seed
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    backend: str = "native"  # native | vllm (tlt_serve/backends)
    tensor_parallel_size: int = 1  # one rank: capture and drafter swaps address one worker

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: {self.backend!r} is not one of {BACKENDS}")
        if self.tensor_parallel_size != 1:
            raise ConfigError(
                f"tensor_parallel_size: {self.tensor_parallel_size} is not supported; every "
                "backend serves a model on one device (run a fleet of replicas: tlt-serve fleet)")
        if self.backend == "vllm" and self.model.batch_invariant:
            raise ConfigError("batch_invariant: the native engine's mode (backend native)")
        if self.model.batch_invariant:
            trees = [b for _, _, b in (*self.spec.auto_trees, *self.spec.suffix_trees)]
            largest = max([*trees, self.spec.budget if self.spec.tree_topk > 1 else 0])
            if largest > INVARIANT_TREE_NODES:
                raise ConfigError(f"batch_invariant: a draft tree of {largest} nodes verifies "
                                  f"without the own kernels (at most {INVARIANT_TREE_NODES})")
        if self.backend == "vllm":
            # What vLLM's engine cannot do, refused rather than ignored.
            if self.spec.tree_topk > 1:
                raise ConfigError("tree_topk: vLLM's EAGLE drafts chains (backend vllm)")
            arctic = importlib.util.find_spec("arctic_inference") is not None
            if self.spec.method == "suffix" and not arctic:
                raise ConfigError("speculative: suffix on backend vllm is vLLM's suffix decoding, "
                                  "which needs arctic-inference (scripts/install.sh --vllm)")
            if self.capture.enabled and not (self.spec.drafter
                                             and self.spec.method in ("drafter", "auto")):
                raise ConfigError("capture: on backend vllm it needs a drafter "
                                  "(--speculative drafter/auto --drafter PATH): the samples' "
                                  "features are what vLLM hands its EAGLE drafter")
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.spec.validate()
        self.capture.validate()


@dataclass(frozen=True)
class TrainingConfig:
    """The co-located drafter trainer, as the server sees it (``trainer/online.py`` trains)."""

    enabled: bool = False  # --train-drafter: start and supervise the trainer process
    max_running: int = 0  # it may train while at most this many requests are in flight
    state_dir: str | None = None  # its checkpoints (None: under the server's cache dir)
    restart_delay_s: float = 2.0  # wait before restarting a trainer that exited
    threads: int | None = None  # the trainer's torch threads (a CPU budget); None: torch's
    # The trainer's CPU priority (nice 0-19): at 19 it gets the cycles nothing else on the
    # machine wants (an RL client's policy update beside the server, the engine's own gaps).
    nice: int = 19
    device: str = "cpu"  # where it trains; on the engine's GPU it trains in the engine's gaps
    memory_bytes: int = 0  # on a GPU: the most it allocates there (0: no cap)

    def busy(self, in_flight: int) -> bool:
        """No spare capacity for training: more than ``max_running`` requests in flight."""
        return in_flight > self.max_running

    def validate(self) -> None:
        if self.max_running < 0:
            raise ConfigError(f"train_max_running: must be >= 0, got {self.max_running}")
        if self.restart_delay_s < 0:
            raise ConfigError(f"restart_delay_s: must be >= 0, got {self.restart_delay_s}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"trainer_threads: must be >= 1, got {self.threads}")
        if not 0 <= self.nice <= 19:
            raise ConfigError(f"trainer_nice: must be in [0, 19], got {self.nice}")
        if not is_device(self.device):
            raise ConfigError(f"trainer_device: {self.device!r} is not cpu, cuda or cuda:N")
        if self.memory_bytes < 0:
            raise ConfigError(f"trainer_memory_gib: must be >= 0, got {self.memory_bytes}")


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_key: str | None = None  # if set, admin routes need it (and the API key cannot)
    request_timeout_s: float | None = None  # a request still running after this is aborted
    max_body_bytes: int = 64 << 20  # JSON bodies above this get 413 (weight uploads stream)
    served_model_name: str | None = None  # name reported by /v1/models; default: the model arg
    tool_call_parser: str = "auto"  # auto (from the chat template) | hermes | llama3_json | none
    log_level: str = "info"
    register: str | None = None  # an sglang-router URL: join it once serving, leave at exit
    advertise_url: str | None = None  # the URL the router reaches this server at

    @property
    def own_url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"

    def validate(self) -> None:
        self.engine.validate()
        self.training.validate()
        for name in ("register", "advertise_url"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ConfigError(f"{name}: must be an http(s):// URL, got {url!r}")
        if self.register and not self.advertise_url and self.host in ("0.0.0.0", "::", ""):
            raise ConfigError("advertise_url: with --register and a wildcard --host, give the "
                              "URL the router reaches this server at")
        if self.register and not self.advertise_url and self.port == 0:
            raise ConfigError("advertise_url: with --register and --port 0, give the URL")
        if self.training.enabled and not self.engine.capture.enabled:
            raise ConfigError("capture: --train-drafter trains on captured samples (enable it)")
        if self.training.enabled and self.engine.spec.proposer != "drafter":
            raise ConfigError(
                "drafter: --train-drafter improves a served drafter: give --speculative "
                "drafter|auto --drafter PATH (e.g. from tlt-train warmup)"
            )
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout: must be > 0 s, got {self.request_timeout_s}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser: one of {', '.join(TOOL_CALL_PARSERS)}, got "
                              f"{self.tool_call_parser!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_mb: must be >= 1 KiB, got {self.max_body_bytes} bytes")
        if self.api_key and self.api_key == self.admin_key:
            raise ConfigError("admin_key: must differ from the API key")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
