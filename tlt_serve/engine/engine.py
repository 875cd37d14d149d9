"""The engine: one loop, ``step()`` = schedule → forward → sample → capture → postprocess.

Not thread-safe: exactly one thread calls its methods (the offline LLM, or the native
backend's process loop, which applies control messages between steps). Speculation comes in
through ``speculation.Speculation`` (plain decoding without it); what RL changes between
steps (weights, weight sync, the drafter) is the native backend's (``backends/native``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tlt_serve.config import EngineConfig
from tlt_serve.engine.capture import CaptureBuffer
from tlt_serve.engine.detokenizer import Detokenizer
from tlt_serve.engine.features import committed_features
from tlt_serve.engine.grammar import Grammars
from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.engine.prefix_cache import Entry, PrefixCache, salted
from tlt_serve.engine.request import Request
from tlt_serve.engine.runner import ModelRunner
from tlt_serve.engine.sampler import Sampler
from tlt_serve.engine.scheduler import (
    MIXED_PADDED_QUERIES,
    Emitted,
    Sampled,
    ScheduledBatch,
    Scheduler,
)
from tlt_serve.engine.scoring import first_needed, score_prompts
from tlt_serve.engine.speculation import SpeculationBuilder, plain_decoding
from tlt_serve.engine.stats import EngineStats
from tlt_serve.engine.step_graphs import StepGraphs
from tlt_serve.models.loader import build_model
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer
from tlt_serve.sampling_params import ParamError, SamplingParams, logprob_limit

log = logging.getLogger("tlt_serve.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    def __init__(
        self, config: EngineConfig, speculation: SpeculationBuilder = plain_decoding
    ) -> None:
        """Loads the model and builds the loop's parts; ``speculation`` builds what decides
        and verifies drafts (``speculative.decoder.build_spec_decoder``)."""
        config.validate()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        mc = config.model
        self.model_path: Path = resolve_model_path(mc.model)
        self.tokenizer = load_tokenizer(self.model_path)
        t0 = time.perf_counter()
        self.model = build_model(self.model_path, DTYPES[mc.dtype], mc.max_model_len, mc.device,
                                 batch_invariant=mc.batch_invariant)
        log.info("loaded %s (%s) in %.1fs", self.model_path, mc.dtype, time.perf_counter() - t0)
        self.kv = KVCache(
            self.model.cfg, config.cache.max_num_seqs, mc.max_model_len, DTYPES[mc.dtype], mc.device
        )
        rows = config.cache.max_num_seqs
        self.spec = speculation(config.spec, self.model, rows, mc.max_model_len, config.seed)
        self.capture = CaptureBuffer(config.capture, seed=config.seed)
        graphs = None
        if mc.device.startswith("cuda") and not mc.enforce_eager:
            graphs = StepGraphs(self.model, self.kv, self.spec.feature_layers,
                                compile=mc.compile, attention=mc.attention_backend)
            t1 = time.perf_counter()
            depth = 0 if config.spec.method == "off" else config.spec.num_draft_tokens
            graphs.warm((1, 1 + depth) if depth else (1,))
            log.info("captured %d CUDA graphs%s in %.1fs", len(graphs.steps),
                     " (layers compiled)" if graphs.layer_fn else "", time.perf_counter() - t1)
        self.runner = ModelRunner(self.model, self.kv, mc.device, self.spec.feature_layers,
                                  graphs)
        self.prefix = (PrefixCache(self.kv.copy_row, swap_rows=self.kv.swap_rows)
                       if config.cache.prefix_cache else None)
        if self.prefix is not None and (self.spec.needs_features or self.capture.enabled):
            cfg = self.model.cfg  # a feature: the chosen layers' residuals, or the last norm
            self.kv.keep_features(cfg.hidden_size * max(1, len(self.spec.feature_layers)))
        self.scheduler = Scheduler(
            num_rows=rows,
            max_len=mc.max_model_len,
            max_prefill_tokens=config.scheduler.max_prefill_tokens,
            eos_ids=self.tokenizer.eos_ids,
            move_row=self._move_row,
            keep=None if self.prefix is None else self._finishing,
            kept=None if self.prefix is None else self._finished,
            cached=None if self.prefix is None else self._cached_len,
            mixed=(max(self.model.packed_queries(), MIXED_PADDED_QUERIES)
                   if config.scheduler.mixed_steps else 0),
        )
        # row → (tokens whose KV it holds, its cache key)
        self._finishing_rows: dict[int, tuple[list[int], str]] = {}
        # the running sources the scheduler's estimates read, gathered once per schedule
        self._estimate_sources: list[Entry] | None = None
        self.sampler = Sampler(config.seed)
        self.grammars = Grammars(self.tokenizer.hf, self.vocab_size)
        self.stats = EngineStats()
        self.weight_version = "0"

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> list[str]:
        """Queue a request; with ``params.n > 1`` its n samples share one prefill.

        Returns the engine ids of the samples (``rid`` itself when n == 1, else ``rid#i``).
        Raises ParamError for a prompt the engine cannot run.
        """
        self._check_prompt(prompt_ids)
        params.check_prompt(len(prompt_ids))
        params.check_logprobs(logprob_limit(self.config.model.max_logprobs, self.vocab_size))
        if len(self.scheduler.waiting) + params.n > self.config.scheduler.max_waiting:
            # n samples take n queue places: count them all, or a big n overshoots the cap.
            raise OverflowError(f"queue full ({self.config.scheduler.max_waiting} waiting)")
        rids = sample_rids(rid, params.n)
        for i, sub in enumerate(rids):
            seed = None if params.seed is None else params.seed + i
            self.scheduler.add(
                Request(
                    rid=sub,
                    prompt_ids=list(prompt_ids),
                    params=params,
                    detok=Detokenizer(
                        self.tokenizer.hf, prompt_ids, params.skip_special_tokens, params.stop,
                        keep_stop=params.include_stop_in_text,
                        spaces_between_special_tokens=params.spaces_between_special_tokens,
                    ),
                    group=rid if params.n > 1 else None,
                    generator=None if seed is None else torch.Generator().manual_seed(seed),
                    grammar=(None if params.json_schema is None
                             else self.grammars.matcher(params.json_schema)),
                )
            )
        self.stats.on_add(len(rids), len(prompt_ids))
        return rids

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ParamError("input_ids", "prompt is empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ParamError(
                "input_ids", f"token id {bad} outside vocabulary [0, {self.vocab_size})"
            )
        limit = self.config.model.max_model_len - 1
        if len(prompt_ids) > limit:
            raise ParamError(
                "input_ids", f"prompt has {len(prompt_ids)} tokens, the limit is {limit}"
            )

    def abort(self, rid: str) -> list[StepOutput]:
        """Abort a request (all its samples); returns their final outputs (partial tokens)."""
        family = [r for r in self._requests() if r.rid == rid or r.group == rid]
        outs = [self.scheduler.abort(r.rid, self.weight_version) for r in family]
        self.spec.release(family)
        self.capture.release(family)
        return [o for o in outs if o is not None]

    def abort_all(self) -> list[StepOutput]:
        reqs = self._requests()
        outs = self.scheduler.abort_all(self.weight_version)
        self.spec.release(reqs)
        self.capture.release(reqs)
        return outs

    def _requests(self) -> list[Request]:
        return list(self.scheduler.waiting) + self.scheduler.running

    def _move_row(self, src: int, dst: int, length: int) -> None:
        kept = self._finishing_rows.pop(dst, None)
        if kept is None:
            self.kv.copy_row(src, dst, length)
        else:  # a finished row the prefix cache keeps: it goes where the moved one was
            self.kv.swap_rows(src, dst, max(length, len(kept[0])))
            self._finishing_rows[src] = kept
        self.spec.move_row(src, dst, length)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the prefix cache ------------------------------------------------------------------
    def _reuse_prefixes(self, batch: ScheduledBatch) -> None:
        """A prefill's requests start from the longest cached prefix of their prompts. A
        drafter or capture, which need every prompt position's features, find the prefix's
        kept beside its KV (``KVCache.keep_features``: both are configured at start, and so
        is the store)."""
        admitted = batch.prefilling
        for r in admitted:
            r.kv_version = self.weight_version
        if self.prefix is None:
            return
        leads = {id(r) for r in batch.forward[batch.decodes :]}
        spare = range(max(r.row for r in admitted) + 1, self.kv.rows)
        claims = [(r.row, _reusable(r) if id(r) in leads else None) for r in admitted]
        keys = [salted(self.weight_version, r.params.cache_salt) for r in admitted]
        got = self.prefix.admit(claims, keys, spare, self._running_sources(full=True))
        for r, n in zip(admitted, got, strict=True):
            if id(r) in leads:
                r.cached_tokens = n

    def _running_sources(self, full: bool) -> list[Entry]:
        """The running sequences whose KV is computed, under the weights serving now, as
        read-only sources of the prefix cache: every token fed so far (``full``), or just
        their prompts (an estimate that copies no lists)."""
        return [Entry(r.row, (r.prompt_ids + r.output_ids)[: r.num_tokens - 1] if full
                      else r.prompt_ids, salted(self.weight_version, r.params.cache_salt))
                for r in self.scheduler.running
                if r.output_ids and r.kv_version == self.weight_version]

    def _cached_len(self, req: Request) -> int:
        """The scheduler's estimate of how much of ``req``'s prompt the cache supplies."""
        assert self.prefix is not None
        if self._estimate_sources is None:  # the step's admissions are not sources: no change
            self._estimate_sources = self._running_sources(full=False)
        key = salted(self.weight_version, req.params.cache_salt)
        return self.prefix.cached_len(_reusable(req), key, self._estimate_sources)

    def _finishing(self, reqs: list[Request]) -> None:
        """Finished sequences whose KV was all computed under the weights serving now: kept
        once their rows have moved (``_move_row`` swaps instead of overwriting them)."""
        for r in reqs:
            if r.kv_version == self.weight_version:
                tokens = (r.prompt_ids + r.output_ids)[: r.num_tokens - 1]
                self._finishing_rows[r.row] = (tokens, salted(r.kv_version, r.params.cache_salt))

    def _finished(self) -> None:
        if self.prefix is not None:
            for row, (tokens, key) in self._finishing_rows.items():
                self.prefix.keep(tokens, row, key)
        self._finishing_rows = {}

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one target forward for the scheduled batch and return each request's delta.

        A decode batch may speculate: the proposer drafts (chains or trees), one forward
        scores every request's last token plus its drafts, and verification commits the
        accepted drafts plus one token per request.
        """
        self._estimate_sources = None
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if batch.is_prefill:
            self._reuse_prefixes(batch)
        t0 = time.perf_counter()
        plan = None if any(r.grammar is not None for r in batch.samplers) else self.spec.plan(batch)
        emitted: Sampled | Emitted
        if plan is None:
            run = self.runner.run(batch)
            if batch.is_prefill:
                score_prompts(self.model, batch, run.hidden)
            emitted = self.sampler.sample(_sampled_rows(run.logits, batch.logit_index),
                                          batch.samplers)
        else:
            run, emitted = self.spec.verify(
                plan, batch.forward, self.runner, self.sampler.generator
            )
        if self.spec.needs_features or self.capture.enabled:
            committed = committed_features(batch, run, emitted, self.spec.feature_layers,
                                           self.kv.features)
            self.spec.observe(committed)
            self.capture.observe(committed, self.weight_version)
        outputs = self.scheduler.postprocess(batch, emitted, self.weight_version)
        if self.capture.enabled:
            done = [r for r in batch.samplers if r.finished]
            self.capture.finish(done, self.spec.drafter_version)
        seconds = time.perf_counter() - t0
        self.spec.end_step(batch, outputs, seconds)
        self.stats.on_step(batch, emitted, outputs, seconds)
        return outputs

    # ---- weights ---------------------------------------------------------------------------
    def weights_replaced(self, version: str) -> None:
        """The target's parameters were replaced in place (call between steps): outputs from
        the next step on report ``version``, and the proposers hear of it (history written
        under the old weights counts less). Updates: ``backends/native/updates.py``."""
        self.weight_version = version
        self.spec.weights_changed()
        if self.prefix is not None:
            self.prefix.clear()  # KV computed under the old weights is never reused

    def relabel_weights(self, version: str) -> None:
        """Report the current weights under ``version`` (``/update_weight_version``)."""
        if not version:
            raise ParamError("new_version", "must be a non-empty string")
        self.weight_version = version


def _sampled_rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """logits [N, V] → the rows the samplers read, in their order: ``logits`` itself when
    that is every row in order (a decode step; indexing would copy 25 MB at 128 rows of
    the default model's vocabulary)."""
    if index == list(range(logits.shape[0])):
        return logits
    return logits[index]


def _reusable(req: Request) -> list[int]:
    """The part of a prompt whose KV a cached prefix may supply: a scored prompt computes
    every position its scores read."""
    if req.params.scores_prompt:
        return req.prompt_ids[: first_needed(req) + 1]
    return req.prompt_ids


def sample_rids(rid: str, n: int) -> list[str]:
    """Engine ids of a request's samples: ``rid`` itself when n == 1, else ``rid#0..``."""
    return [rid] if n == 1 else [f"{rid}#{i}" for i in range(n)]


def next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"
