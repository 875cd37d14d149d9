"""Drafter training samples taken from the serving forwards, in a bounded buffer.

Every target forward (prefill, plain decode, verification) already computes the feature of
each position it commits — the same tensors a drafter catches up from (``engine/features.py``).
Capture keeps them, per sampled sequence, with no extra forward: when the sequence finishes,
its tokens and features become one ``TrainingSample``. Only the accepted path is ever
committed, so rejected drafts never reach the buffer.

Bounds: the buffer holds at most ``max_bytes`` (features + tokens); adding past it evicts the
oldest samples. A sequence is kept with probability ``sample_rate`` (one seeded draw when it
first commits). In-flight sequences hold their features until they finish (at most the KV
cache's worth); an aborted sequence, or one whose target weights changed mid-generation (its
features would mix two targets), is dropped.

Where the model runs on a GPU the features stay there (``on_device``, the default): a step
never waits for a copy to the host. A consumer on the same GPU borrows them by reference
(``encode_shared``, ``handoff.py``); one elsewhere gets them through one host copy per pull
(``encode_samples``).

Samples are numbered in capture order (``seq``); a consumer pulls everything after its
cursor (``take``), so several consumers and restarts need no state here.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from tlt_serve.config import CaptureConfig
from tlt_serve.engine.handoff import Lent, open_shared
from tlt_serve.engine.request import Request

# A live sequence's feature chunks are joined into one past this many (on a GPU: fewer small
# blocks held in the allocator while a long sequence runs).
COMPACT_CHUNKS = 32


@dataclass(frozen=True, eq=False)
class TrainingSample:
    """One served sequence: token ids and the target feature of each position.

    ``features[i]`` is the feature the target computed at position i; the last generated
    token was never fed back, so it is not in ``tokens`` (pair i = (f_i, x_{i+1}) predicts
    f_{i+1} for i < L - 1).
    """

    seq: int  # capture order, from 1
    tokens: torch.Tensor  # [L] int64: prompt then response
    features: torch.Tensor  # [L, F] the target's dtype
    prompt_len: int
    weight_version: str  # the target every position was computed with
    drafter_version: int | None  # the drafter serving when it finished (None: no drafter)

    @property
    def nbytes(self) -> int:
        return self.features.nbytes + self.tokens.nbytes


@dataclass
class _Live:
    weight_version: str
    chunks: list[torch.Tensor] = field(default_factory=list)  # [m, F] each, in order
    mixed: bool = False  # the target changed while it ran


@dataclass(frozen=True)
class CaptureStats:
    enabled: bool
    samples: int  # in the buffer now
    tokens: int
    bytes: int
    max_bytes: int
    captured: int  # samples ever added (= the newest sample's seq)
    evicted: int  # dropped to stay under max_bytes
    skipped: int  # sequences not drawn (sample_rate), aborted, or mixed-version


class CaptureBuffer:
    def __init__(self, config: CaptureConfig, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)
        self._live: dict[str, _Live | None] = {}  # None: not drawn
        self._buffer: deque[TrainingSample] = deque()
        self._bytes = 0
        self._tokens = 0
        self._seq = 0
        self._evicted = 0
        self._skipped = 0

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def last_seq(self) -> int:
        """The newest sample's number (0 before any)."""
        return self._seq

    def observe(
        self, committed: Iterable[tuple[Request, torch.Tensor]], weight_version: str
    ) -> None:
        """Features [m, F] of each request's newly committed positions (read-only tensors, on
        the model's device; kept there when ``on_device``, else in host memory)."""
        if not self.enabled:
            return
        lives: list[_Live] = []
        chunks: list[torch.Tensor] = []  # [m, F]: lives[i]'s new features
        for req, feats in committed:
            if req.rid not in self._live:
                self._live[req.rid] = _Live(weight_version) if self.draw() else None
            live = self._live[req.rid]
            if live is None:
                continue
            live.mixed |= live.weight_version != weight_version
            lives.append(live)
            chunks.append(feats)
        kept = chunks if self.config.on_device else _to_host(chunks)
        for live, feats in zip(lives, kept, strict=True):
            live.chunks.append(feats)
            if len(live.chunks) >= COMPACT_CHUNKS:
                live.chunks = [torch.cat(live.chunks)]

    def finish(self, reqs: Sequence[Request], drafter_version: int | None) -> None:
        """Turn finished requests into samples (call after postprocess)."""
        for req in reqs:
            if req.rid not in self._live:
                continue
            live = self._live.pop(req.rid)
            if live is None or live.mixed or not live.chunks:
                self.skip()
                continue
            feats = torch.cat(live.chunks) if len(live.chunks) > 1 else live.chunks[0]  # [L, F]
            ids = req.prompt_ids + req.output_ids
            L = min(feats.shape[0], len(ids))
            self.add(torch.tensor(ids[:L], dtype=torch.long), feats[:L], len(req.prompt_ids),
                     live.weight_version, drafter_version)

    def release(self, reqs: Iterable[Request]) -> None:
        """Forget aborted requests."""
        for req in reqs:
            if req.rid in self._live:
                self._live.pop(req.rid)
                self._skipped += 1

    def draw(self) -> bool:
        """Whether a sequence starting now is kept (``sample_rate``; one seeded draw)."""
        return self._rng.random() < self.config.sample_rate

    def skip(self) -> None:
        """Count a sequence that was not kept (not drawn, aborted, mixed, incomplete)."""
        self._skipped += 1

    def add(
        self, tokens: torch.Tensor, features: torch.Tensor, prompt_len: int,
        weight_version: str, drafter_version: int | None,
    ) -> TrainingSample:
        """Keep one finished sequence (``tokens`` [L], ``features`` [L, F]) as the next
        sample, evicting the oldest past ``max_bytes``."""
        sample = TrainingSample(self._seq + 1, tokens, features, prompt_len, weight_version,
                                drafter_version)
        self._add(sample)
        return sample

    def _add(self, sample: TrainingSample) -> None:
        self._seq = sample.seq
        self._buffer.append(sample)
        self._bytes += sample.nbytes
        self._tokens += int(sample.tokens.shape[0])
        while self._bytes > self.config.max_bytes and self._buffer:
            old = self._buffer.popleft()
            self._bytes -= old.nbytes
            self._tokens -= int(old.tokens.shape[0])
            self._evicted += 1

    def take(self, after: int, max_bytes: int) -> list[TrainingSample]:
        """Samples with ``seq > after`` in order, up to ``max_bytes`` (at least one when any
        is there). Nothing is removed: the buffer is a window, consumers keep cursors."""
        out: list[TrainingSample] = []
        size = 0
        for s in self._buffer:
            if s.seq <= after:
                continue
            if out and size + s.nbytes > max_bytes:
                break
            out.append(s)
            size += s.nbytes
        return out

    def stats(self) -> CaptureStats:
        return CaptureStats(
            enabled=self.enabled,
            samples=len(self._buffer),
            tokens=self._tokens,
            bytes=self._bytes,
            max_bytes=self.config.max_bytes,
            captured=self._seq,
            evicted=self._evicted,
            skipped=self._skipped,
        )


def _to_host(feats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors [m, F] on the CPU: CPU ones as they are, device ones in one copy for all (not
    one per tensor), each then owning its memory."""
    if not feats or feats[0].device.type == "cpu":
        return feats
    host = torch.cat(feats).cpu()  # [sum m, F]
    return [part.clone() for part in host.split([f.shape[0] for f in feats])]


# ---- wire format (engine → trainer) ----------------------------------------------------------


def encode_samples(samples: Sequence[TrainingSample]) -> bytes:
    """Samples as one safetensors blob: ``tokens.<seq>`` / ``features.<seq>`` tensors and a
    ``samples`` JSON list (seq, prompt_len, weight_version, drafter_version) in the metadata.
    Features kept on a GPU come to the host in one copy."""
    tensors = _tokens(samples)
    for s, feats in zip(samples, _to_host([s.features for s in samples]), strict=True):
        tensors[f"features.{s.seq}"] = feats.contiguous()
    return save(tensors, metadata={"samples": _meta(samples)})


def encode_shared(samples: Sequence[TrainingSample], lent: Lent) -> bytes:
    """As ``encode_samples``, but the features go by reference: joined into one tensor where
    they are (on the GPU: one kernel, no host copy), lent (``lent`` keeps it alive until the
    borrower asks again), its handle in the metadata (``features_ref``, rows per sample).
    Only a process on this machine can open it (``decode_samples``)."""
    meta = {"samples": _meta(samples)}
    if samples:
        joined = torch.cat([s.features for s in samples])  # [sum L, F]
        rows = [int(s.features.shape[0]) for s in samples]
        meta["features_ref"] = json.dumps({"tensor": lent.lend(joined), "rows": rows})
    return save(_tokens(samples), metadata=meta)


def _tokens(samples: Sequence[TrainingSample]) -> dict[str, torch.Tensor]:
    return {f"tokens.{s.seq}": s.tokens.contiguous() for s in samples}


def _meta(samples: Sequence[TrainingSample]) -> str:
    return json.dumps([[s.seq, s.prompt_len, s.weight_version, s.drafter_version]
                       for s in samples])


def decode_samples(blob: bytes) -> list[TrainingSample]:
    """Inverse of ``encode_samples`` and ``encode_shared`` (lent features are copied out: the
    samples own their memory, on the device the lender kept them on); ValueError on a
    malformed blob or a loan that cannot be opened here."""
    try:
        tensors = load(blob)
        header = header_metadata(blob)
        meta = json.loads(header["samples"])
        if "features_ref" in header:
            ref = json.loads(header["features_ref"])
            lent = open_shared(ref["tensor"])  # [sum L, F], the lender's memory
            rows = [int(n) for n in ref["rows"]]
            if len(rows) != len(meta) or sum(rows) != lent.shape[0]:
                raise ValueError("features_ref rows do not match the samples")
            feats = [part.clone() for part in lent.split(rows)]
            del lent
        else:
            feats = [tensors[f"features.{seq}"] for seq, *_ in meta]
        return [
            TrainingSample(
                seq=int(seq),
                tokens=tensors[f"tokens.{seq}"],
                features=f,
                prompt_len=int(prompt_len),
                weight_version=str(weight_version),
                drafter_version=None if drafter is None else int(drafter),
            )
            for (seq, prompt_len, weight_version, drafter), f in zip(meta, feats, strict=True)
        ]
    except (KeyError, TypeError, ValueError, SafetensorError) as err:
        raise ValueError(f"malformed sample blob: {err!r}") from err


def header_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte little-endian header size, JSON)."""
    if len(blob) < 8:
        raise ValueError("safetensors blob shorter than its header size")
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise ValueError("safetensors __metadata__ is not an object")
    return meta
