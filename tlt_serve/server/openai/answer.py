"""What an OpenAI answer says, whole or streamed: the parts both APIs share, and completions."""

from __future__ import annotations

import time

import msgspec

from tlt_serve.engine.outputs import RequestResult, StepOutput
from tlt_serve.server.common.jobs import Job, SampleBook, sse_event
from tlt_serve.server.common.state import ServerState
from tlt_serve.server.openai.format import (
    LogprobFormatter,
    finish_str,
    joined,
    latest_version,
    merge_delta,
    stop_reason,
    usage,
)
from tlt_serve.server.openai.protocol import (
    ChatReq,
    CompletionChoice,
    CompletionLogprobs,
    CompletionReq,
    CompletionResponse,
    PromptLogprobsOut,
)


def event(obj: object) -> bytes:
    return sse_event(msgspec.json.encode(obj))


def _prompt_texts(st: ServerState, req: CompletionReq, jobs: list[Job]) -> list[str]:
    """What an echo shows of each prompt: the text sent, or the token ids' decoding."""
    if isinstance(req.prompt, str):
        return [req.prompt]
    if all(isinstance(p, str) for p in req.prompt):
        return [str(p) for p in req.prompt]
    return [st.tokenizer.hf.decode(job.prompt_ids) for job in jobs]


class Answer:
    """Shared by both APIs: ids, timestamps, stream flags, logprob formatting."""

    def __init__(self, st: ServerState, prefix: str, jobs: list[Job], include_usage: bool,
                 req: CompletionReq | ChatReq) -> None:
        self.st = st
        self.id = f"{prefix}-{jobs[0].rid}"
        self.created = int(time.time())
        self.include_usage = include_usage
        self.token_ids = req.return_token_ids
        self.prompt_top = req.prompt_logprobs  # None: no prompt_logprobs field
        self.lp = LogprobFormatter(st.tokenizer, req.return_tokens_as_token_ids)
        self.eos = st.tokenizer.eos_ids
        self.text_offsets: dict[int, int] = {}

    def _usage_field(self) -> None | msgspec.UnsetType:
        return None if self.include_usage else msgspec.UNSET

    def _prompt_logprobs(self, r: RequestResult) -> PromptLogprobsOut | msgspec.UnsetType:
        if self.prompt_top is None or r.prompt_logprobs is None:
            return msgspec.UNSET
        return self.lp.prompt_logprobs(r.prompt_ids, r.prompt_logprobs, self.prompt_top)


class CompletionAnswer(Answer):
    def __init__(self, st: ServerState, req: CompletionReq, jobs: list[Job]) -> None:
        opts = req.stream_options
        super().__init__(st, "cmpl", jobs, bool(opts and opts.include_usage), req)
        self.started: set[int] = set()
        self.echo = req.echo
        self.prompt_texts = _prompt_texts(st, req, jobs) if req.echo else []

    def _logprobs(self, book: SampleBook, k: int, r: RequestResult,
                  offset: int) -> tuple[CompletionLogprobs | None, int]:
        """A choice's logprobs from ``offset`` on: an echoed prompt's first (when ``r``
        starts the choice), then its new tokens'."""
        params = book.job(k).params
        if not params.logprobs:
            return None, offset
        head = None
        if self.echo and r.prompt_logprobs is not None:
            head, offset = self.lp.echoed(r.prompt_ids, r.prompt_logprobs, params.top_logprobs)
        out, end = self.lp.completion(r.token_ids, r.logprobs, r.top_logprobs, offset)
        return (out if head is None else joined(head, out)), end

    def response(self, book: SampleBook) -> CompletionResponse:
        choices = []
        for k, r in enumerate(book.samples):
            params = book.job(k).params
            logprobs = self._logprobs(book, k, r, 0)[0]
            text = self.prompt_texts[book.job_of[k]] + r.text if self.echo else r.text
            choice = CompletionChoice(
                k, text, logprobs, finish_str(r.finish), stop_reason(r.finish, params, self.eos)
            )
            if self.token_ids:
                choice.token_ids, choice.prompt_token_ids = list(r.token_ids), list(r.prompt_ids)
            choice.prompt_logprobs = self._prompt_logprobs(r)
            choices.append(choice)
        return CompletionResponse(self.id, self.created, self.st.model_name, choices,
                                  latest_version(book), usage=usage(book))

    def opening(self, book: SampleBook) -> list[bytes]:
        return []

    def chunk(self, book: SampleBook, k: int, new: list[StepOutput]) -> bytes | None:
        d, params = merge_delta(new), book.job(k).params
        d.prompt_ids = book.samples[k].prompt_ids
        first = k not in self.started
        logprobs, self.text_offsets[k] = self._logprobs(book, k, d, self.text_offsets.get(k, 0))
        text = self.prompt_texts[book.job_of[k]] + d.text if self.echo and first else d.text
        choice = CompletionChoice(
            k, text, logprobs, finish_str(d.finish), stop_reason(d.finish, params, self.eos)
        )
        if self.token_ids:
            choice.token_ids = list(d.token_ids)
            if first:
                choice.prompt_token_ids = list(d.prompt_ids)
        choice.prompt_logprobs = self._prompt_logprobs(d)
        self.started.add(k)
        return event(CompletionResponse(self.id, self.created, self.st.model_name, [choice],
                                         d.weight_version, usage=self._usage_field()))

    def closing(self, book: SampleBook) -> bytes | None:
        if not self.include_usage:
            return None
        return event(CompletionResponse(self.id, self.created, self.st.model_name, [],
                                         latest_version(book), usage=usage(book)))
