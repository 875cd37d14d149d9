"""Frozen, layered configuration: Model / Cache / Scheduler ⊂ Engine ⊂ Server.

Building a config touches no disk and no device; ``validate`` checks ranges and names the
offending field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the field name."""


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2-135m"  # named default, local HF dir, .gguf file, or hub repo id
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_model_len: int = 2048  # prompt + output tokens per sequence
    aux_hidden_layers: tuple[int, ...] = ()  # target layers whose hidden states runs return

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len: must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    max_num_seqs: int = 64  # KV rows: sequences resident at once

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 2048  # padded prompt tokens per prefill forward
    max_waiting: int = 4096  # queued requests beyond which new ones are refused

    def validate(self) -> None:
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens: must be >= 1, got {self.max_prefill_tokens}")
        if self.max_waiting < 1:
            raise ConfigError(f"max_waiting: must be >= 1, got {self.max_waiting}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0  # seeds the shared generator of requests without their own seed
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # name reported by /v1/models; default: the model arg
    log_level: str = "info"

    def validate(self) -> None:
        self.engine.validate()
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
