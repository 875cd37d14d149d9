"""Continuous batching over a slot KV cache. Plain Python: testable without a model.

Invariant: ``running[i].row == i``. Running sequences occupy KV rows 0..N-1; when one
finishes, the last row is moved into its place (``move_row``) so batches stay contiguous.
Each step prefills newly admitted requests (first priority, bounded by ``max_prefill_tokens``
padded tokens and free rows) or decodes one token for every running request; with ``mixed``
both at once: the running requests' tokens ride along with the admitted prompts in one
forward (as vLLM's and SGLang's mixed batches), so an arrival no longer stalls them for a
step, while the step's padded size stays within ``MIXED_PADDING`` times the prefill budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tlt_serve.engine.outputs import StepOutput
from tlt_serve.engine.prefix_cache import common_prefix
from tlt_serve.engine.request import FinishReason, Request, Status, TopLogprobs
from tlt_serve.sampling_params import SamplingParams

# A prompt sharing this many tokens or more with one a prefill step computes waits for the next
# step and copies them (the prefix cache's running sources): computing them is worth more than
# a step's wait from about a few dozen tokens (a prefill of 64 tokens costs about a decode step
# of 64 rows here).
SHARED_PREFIX = 64
# A mixed step pads every row to the longest prompt part it computes: its rows x that length
# stay within this many times ``max_prefill_tokens`` (what its index tensors and rotary table
# cost grows with), else the admitted prompts prefill in a step of their own.
MIXED_PADDING = 4
# Where a forward pads around attention (no whole-layer kernel: fp32, CUDA, AVX2-only hosts'
# longer rows), every decoding row of a mixed step attends as many query slots as its longest
# prompt part: there a mixed step takes prompt parts of up to this many tokens, as a verify
# step's rows are long.
MIXED_PADDED_QUERIES = 16
RowMover = Callable[[int, int, int], None]  # (src_row, dst_row, num_tokens)
Keeper = Callable[[list[Request]], None]
CachedLen = Callable[[Request], int]  # prompt tokens a prefix cache would supply (estimate)


@dataclass(frozen=True)
class ScheduledBatch:
    """One forward's worth of work.

    ``forward`` requests run through the model (rows contiguous, in row order): the first
    ``decodes`` are running sequences feeding their last token, the rest prefill their
    prompts from ``cached_tokens`` on. ``samplers`` get one new token each (the decoding ones
    first, in the same order); ``logit_index[i]`` is the ``forward`` entry whose
    last-position logits ``samplers[i]`` samples from (siblings sharing a prefill read their
    leader's). ``copies`` are (leader_row, sibling_row, length) KV copies to apply after the
    forward.
    """

    forward: list[Request]
    samplers: list[Request]
    logit_index: list[int]
    copies: list[tuple[int, int, int]]
    decodes: int

    @property
    def is_prefill(self) -> bool:
        """Whether the step admits requests (their prompts prefill, beside any decodes)."""
        return self.decodes < len(self.forward)

    @property
    def prefilling(self) -> list[Request]:
        """The requests this step admits (the samplers after the decoding ones)."""
        return self.samplers[self.decodes :]


@dataclass(frozen=True)
class Sampled:
    """Per sampler: one token, its logprob, and optional top logprobs (a plain step)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None

    def as_emitted(self) -> Emitted:
        tops = None if self.top_logprobs is None else [[t] for t in self.top_logprobs]
        return Emitted([[t] for t in self.token_ids], [[lp] for lp in self.logprobs], tops)


@dataclass(frozen=True)
class Emitted:
    """Per sampler: the tokens a step produced for it, in order (a speculative step can
    produce several), with their logprobs and optional top logprobs. A verify step also
    says how many tokens each sampler drafted and how many of them were accepted."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[TopLogprobs]] | None
    drafted: list[int] | None = None
    accepted: list[int] | None = None
    path: list[list[int]] | None = None  # tree steps: verify positions of the tokens' inputs
    drafter_version: int | None = None  # the drafter that proposed (None: model-free drafts)


class Scheduler:
    def __init__(
        self,
        num_rows: int,
        max_len: int,
        max_prefill_tokens: int,
        eos_ids: frozenset[int],
        move_row: RowMover,
        keep: Keeper | None = None,
        kept: Callable[[], None] | None = None,
        cached: CachedLen | None = None,
        mixed: int = 0,
    ) -> None:
        self.num_rows = num_rows
        self.max_len = max_len
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_ids = eos_ids
        self.move_row = move_row
        # the prefix cache: told of the finished rows before rows move, and when they have
        self.keep, self.kept = keep, kept
        self.cached = cached  # what the prefix cache holds of a prompt: not computed again
        # running requests decode in the steps that admit prompt parts of up to this many
        # tokens (0: never)
        self.mixed = mixed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.admitting = True  # False: a drain; the waiting ones wait, the running ones run

    # ---- admission -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if len(req.prompt_ids) + 1 > self.max_len:
            raise ValueError(
                f"prompt: {len(req.prompt_ids)} tokens leave no room for output "
                f"(max_model_len {self.max_len})"
            )
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        prefill = self._schedule_prefill() if self.admitting else None
        return prefill or self._schedule_decode()

    def _share_key(self, req: Request) -> object | None:
        """What a request shares one prefill with in a step: its group's samples (n > 1),
        and, with the prefix cache on, separate requests of the same prompt and cache salt
        (slime sends a prompt's n samples so); a scored prompt computes its own."""
        if req.group is not None:
            return req.group
        if self.keep is None or req.params.scores_prompt:
            return None
        return (tuple(req.prompt_ids), req.params.cache_salt)

    def _defer(self, req: Request, forward: list[Request]) -> bool:
        """With the prefix cache on: whether ``req`` starts with ``SHARED_PREFIX`` tokens or
        more of a prompt this step computes (a system prompt that many conversations open
        with, arriving together). It waits a step and takes that prompt's KV from its row
        then, instead of computing it again beside it."""
        if self.keep is None or req.params.scores_prompt:
            return False
        salt = req.params.cache_salt
        return any(r.params.cache_salt == salt and common_prefix(
            r.prompt_ids, req.prompt_ids, len(req.prompt_ids) - 1) >= SHARED_PREFIX
            for r in forward)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        if not self.waiting or len(self.running) >= self.num_rows:
            return None
        first = self._part(self.waiting[0])
        decoding = list(self.running) if 0 < first <= self.mixed else []
        if decoding and not self._fits(len(decoding), 1, first):
            decoding = []  # the first prompt is too long to pad the running rows to
        forward: list[Request] = []
        samplers: list[Request] = []
        logit_index: list[int] = []
        leaders: dict[object, int] = {}  # share key → its leader's index in forward
        lead_of: dict[int, Request] = {}  # id(sibling) → the request whose prefill it shares
        longest = 0  # the longest prompt part computed
        while self.waiting and len(self.running) < self.num_rows:
            req = self.waiting[0]
            key = self._share_key(req)
            lead = leaders.get(key) if key is not None else None
            if lead is not None and forward[lead].prompt_ids == req.prompt_ids:
                lead_of[id(req)] = forward[lead]
                req.cached_tokens = len(req.prompt_ids)
                logit_index.append(len(decoding) + lead)
            else:
                part = self._part(req) if samplers else first
                if forward and (not self._fits(len(decoding), len(forward) + 1,
                                               max(longest, part))
                                or (decoding and part > self.mixed)
                                or self._defer(req, forward)):
                    break
                longest = max(longest, part)
                if key is not None:
                    leaders[key] = len(forward)
                logit_index.append(len(decoding) + len(forward))
                forward.append(req)
            self.waiting.popleft()
            req.row, req.status = len(self.running), Status.RUNNING
            self.running.append(req)
            samplers.append(req)
        copies = self._place_siblings(forward, samplers, lead_of)
        return ScheduledBatch(decoding + forward, decoding + samplers,
                              list(range(len(decoding))) + logit_index, copies, len(decoding))

    def _part(self, req: Request) -> int:
        """The prompt tokens a prefill of ``req`` computes: those the prefix cache lacks."""
        return len(req.prompt_ids) - (self.cached(req) if self.cached is not None else 0)

    def _fits(self, decodes: int, prefills: int, longest: int) -> bool:
        """Whether a step of ``prefills`` prompts padded to ``longest`` tokens (beside
        ``decodes`` running rows padded to it too) keeps within the budgets."""
        if prefills * longest > self.max_prefill_tokens:
            return False
        return (decodes + prefills) * longest <= MIXED_PADDING * self.max_prefill_tokens

    def _place_siblings(
        self, forward: list[Request], admitted: list[Request], lead_of: dict[int, Request]
    ) -> list[tuple[int, int, int]]:
        """Give the forward requests contiguous rows, siblings the rows after them.

        Returns (leader_row, sibling_row, prompt_len) KV copies for after the forward.
        """
        base = admitted[0].row  # the first admitted request always runs the forward
        leads = {id(r) for r in forward}
        siblings = [r for r in admitted if id(r) not in leads]
        for i, req in enumerate(forward + siblings):
            req.row = base + i
            self.running[base + i] = req
        return [(lead_of[id(r)].row, r.row, len(r.prompt_ids)) for r in siblings]

    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self.running:
            return None
        reqs = list(self.running)
        return ScheduledBatch(reqs, reqs, list(range(len(reqs))), [], len(reqs))

    # ---- results ---------------------------------------------------------------------
    def postprocess(
        self, batch: ScheduledBatch, emitted: Sampled | Emitted, version: str
    ) -> list[StepOutput]:
        """Append each sampler's tokens, apply stop rules, free finished rows."""
        em = emitted.as_emitted() if isinstance(emitted, Sampled) else emitted
        outputs = []
        for i, req in enumerate(batch.samplers):
            tops = em.top_logprobs[i] if em.top_logprobs is not None else None
            verified = None
            if em.drafted is not None and em.accepted is not None and em.drafted[i]:
                verified = (em.drafted[i], em.accepted[i], em.drafter_version)
            outputs.append(self._append(req, em.token_ids[i], em.logprobs[i], tops, version,
                                        verified))
        self._release([r for r in batch.samplers if r.finished])
        return outputs

    def _append(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[float],
        tops: list[TopLogprobs] | None,
        version: str,
        verified: tuple[int, int, int | None] | None = None,
    ) -> StepOutput:
        """Append tokens one by one; the first that finishes the request drops the rest. A
        request for none (scoring a prompt) finishes with nothing appended. ``verified``:
        the drafted and accepted counts (and drafter version) of a verify step that drafted
        for it, counted with what it appended."""
        text = ""
        n = 0
        if req.params.max_new_tokens == 0:
            req.finish, tokens = FinishReason("length"), []
        for n, token in enumerate(tokens, start=1):
            req.output_ids.append(token)
            req.logprobs.append(logprobs[n - 1])
            if tops is not None:
                req.top_logprobs.append(tops[n - 1])
            stop_token = self._is_stop_token(req.params, token)
            delta, matched = _detokenize(req, token, stop_token)
            text += delta
            if stop_token:
                req.finish = FinishReason("stop", token)
            else:
                req.finish = self._finish_reason(req, matched)
            if req.grammar is not None:  # advanced by what was committed; done once complete
                req.grammar.accept_token(token)
                if req.finish is None and req.grammar.is_terminated():
                    req.finish = FinishReason("stop", token)
            if req.finish is not None:
                break
        if req.finish is not None:
            req.status = Status.FINISHED
            if req.detok is not None:
                text += req.detok.flush()
        if verified is not None:
            req.spec = req.spec.plus(*verified, appended=n)
        top_list = tops[:n] if tops is not None else []
        return self._output(req, tokens[:n], logprobs[:n], top_list, text, version)

    def _is_stop_token(self, p: SamplingParams, token: int) -> bool:
        return token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)

    def _finish_reason(self, req: Request, matched: str | None) -> FinishReason | None:
        p = req.params
        if matched is not None:
            return FinishReason("stop", matched)
        if len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= self.max_len:
            return FinishReason("length")
        return None

    def _output(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[float],
        top: list[TopLogprobs],
        text: str,
        version: str,
    ) -> StepOutput:
        return StepOutput(
            rid=req.rid,
            token_ids=tokens,
            logprobs=logprobs,
            top_logprobs=top,
            text=text,
            finish=req.finish,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            weight_version=version,
            spec=req.spec,
            prompt_logprobs=req.take_prompt_logprobs(),
        )

    def _release(self, done: list[Request]) -> None:
        """Free rows of finished running requests, compacting: last row moves into the hole.
        ``keep`` hears of them first, ``kept`` when the rows have moved."""
        if self.keep is not None:
            self.keep([r for r in done if r.row >= 0])
        for row in sorted((r.row for r in done if r.row >= 0), reverse=True):
            last = self.running[-1]
            if last.row != row:
                self.move_row(last.row, row, last.num_tokens)
                last.row = row
                self.running[row] = last
            self.running.pop()
        for r in done:
            r.row = -1
        if self.kept is not None:
            self.kept()

    # ---- aborts ----------------------------------------------------------------------
    def abort(self, rid: str, version: str) -> StepOutput | None:
        """Finish ``rid`` now (waiting or running). Returns its final output, or None."""
        req = next((r for r in self.waiting if r.rid == rid), None)
        if req is not None:
            self.waiting.remove(req)
        else:
            req = next((r for r in self.running if r.rid == rid), None)
        if req is None:
            return None
        req.finish, req.status = FinishReason("abort"), Status.FINISHED
        self._release([req])
        text = req.detok.flush() if req.detok is not None else ""
        return self._output(req, [], [], [], text, version)

    def abort_all(self, version: str) -> list[StepOutput]:
        rids = [r.rid for r in self.waiting] + [r.rid for r in self.running]
        return [out for rid in rids if (out := self.abort(rid, version)) is not None]


def _detokenize(req: Request, token: int, stop_token: bool) -> tuple[str, str | None]:
    """The text ``token`` adds and any stop string it completes. A stop token's own text is
    trimmed (as SGLang and vLLM do) unless the request keeps stops in its text."""
    if req.detok is None or (stop_token and not req.params.include_stop_in_text):
        return "", None
    return req.detok.push(token)
