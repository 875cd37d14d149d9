"""Engine results → OpenAI response pieces (finish reasons, logprobs, usage)."""

from __future__ import annotations

from tlt_serve.engine.outputs import RequestResult, StepOutput
from tlt_serve.engine.request import FinishReason, PromptLogprobs
from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.server.common.jobs import SampleBook, token_texts
from tlt_serve.server.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsOut,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)


def finish_str(fin: FinishReason | None) -> str | None:
    return None if fin is None else fin.type  # stop | length | abort (vLLM also says "abort")


def stop_reason(
    fin: FinishReason | None, params: SamplingParams, eos: frozenset[int]
) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id; None for EOS or length."""
    if fin is None or fin.type != "stop":
        return None
    m = fin.matched
    if isinstance(m, int) and m in eos and m not in params.stop_token_ids:
        return None
    return m


def usage(book: SampleBook) -> Usage:
    prompt = sum(len(job.prompt_ids) for job in book.jobs)  # each prompt counts once, not n times
    completion = sum(len(r.token_ids) for r in book.samples)
    # per prompt its leader's (its other samples copy the leader's prompt KV whole)
    cached: dict[int, int] = {}
    for j, r in zip(book.job_of, book.samples, strict=True):
        cached[j] = min(cached.get(j, r.cached_tokens), r.cached_tokens)
    details = PromptTokensDetails(sum(cached.values()))
    return Usage(prompt, completion, prompt + completion, details)


def latest_version(book: SampleBook) -> str:
    """The newest weight version any step of this response ran under."""
    versions = [v for r in book.samples for v in r.weight_versions]
    return _newest(versions)


def _newest(versions: list[str]) -> str:
    if not versions:
        return ""
    if all(v.isdigit() for v in versions):
        return max(versions, key=int)
    return versions[-1]


# ---- logprobs ---------------------------------------------------------------------------


class LogprobFormatter:
    """``as_ids``: tokens shown as ``token_id:{id}`` (vLLM's ``return_tokens_as_token_ids``:
    exact for RL clients, whatever the tokenizer's text for a partial character)."""

    def __init__(self, tok: Tokenizer, as_ids: bool = False) -> None:
        self.tok = tok
        self.as_ids = as_ids

    def texts(self, ids: list[int]) -> list[str]:
        if self.as_ids:
            return [f"token_id:{t}" for t in ids]
        return token_texts(self.tok, ids)

    def _top_texts(self, tops: list[list[tuple[int, float]]]) -> list[list[str]]:
        """The text of every top-logprob token, decoded in one tokenizer call."""
        flat = self.texts([t for row in tops for t, _ in row])
        out, i = [], 0
        for row in tops:
            out.append(flat[i : i + len(row)])
            i += len(row)
        return out

    def completion(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]], offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Completions-API logprobs for these tokens; ``offset`` is where their text starts.

        Returns the logprobs and the offset after them (for the next stream chunk).
        """
        texts = self.texts(ids)
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        top: list[dict[str, float] | None] = []
        top_texts = self._top_texts(tops)
        for i, (text, lp) in enumerate(zip(texts, lps, strict=True)):
            entry = {text: lp}  # the sampled token is always listed, as vLLM does
            if i < len(tops):
                for t_text, (_, t_lp) in zip(top_texts[i], tops[i], strict=True):
                    entry.setdefault(t_text, t_lp)
            top.append(entry)
        values: list[float | None] = list(lps)
        return CompletionLogprobs(texts, values, top, offsets), offset

    def echoed(self, prompt: list[int], scored: PromptLogprobs,
               k: int) -> tuple[CompletionLogprobs, int]:
        """An echoed prompt's logprobs (a position without one, the first: None) and the
        offset after its text."""
        out, end = self.completion(prompt[scored.start :],
                                   [0.0 if lp is None else lp for lp in scored.logprobs],
                                   [top[:k] for top in scored.top], 0)
        out.token_logprobs = list(scored.logprobs)
        out.top_logprobs = [None if lp is None else entry for lp, entry in
                            zip(scored.logprobs, out.top_logprobs or [], strict=True)]
        return out, end

    def prompt_logprobs(self, prompt: list[int], scored: PromptLogprobs,
                        k: int) -> PromptLogprobsOut:
        """vLLM's ``prompt_logprobs``: per position the prompt token's entry and the top
        ``k`` (None at a position with no logprob)."""
        ids = prompt[scored.start :]
        tops = [top[:k] for top in scored.top]
        texts = self.texts(ids)
        top_texts = self._top_texts(tops)
        out: PromptLogprobsOut = [None] * scored.start
        for t, text, lp, rank, top, names in zip(ids, texts, scored.logprobs, scored.ranks,
                                                 tops, top_texts, strict=True):
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): PromptLogprob(lp, rank, text)}
            for r, ((tid, t_lp), name) in enumerate(zip(top, names, strict=True), start=1):
                entry.setdefault(str(tid), PromptLogprob(t_lp, r, name))
            out.append(entry)
        return out

    def chat(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
    ) -> ChatLogprobs:
        texts = self.texts(ids)
        content = []
        top_texts = self._top_texts(tops)
        for i, (text, lp) in enumerate(zip(texts, lps, strict=True)):
            top: list[TopLogprob] = []
            if i < len(tops):
                for t_text, (_, t_lp) in zip(top_texts[i], tops[i], strict=True):
                    top.append(TopLogprob(t_text, t_lp, list(t_text.encode())))
            content.append(TokenLogprob(text, lp, list(text.encode()), top))
        return ChatLogprobs(content)


def joined(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    """Two runs of completion logprobs as one (``tail``'s offsets already absolute)."""
    return CompletionLogprobs(head.tokens + tail.tokens,
                              head.token_logprobs + tail.token_logprobs,
                              (head.top_logprobs or []) + (tail.top_logprobs or []),
                              head.text_offset + tail.text_offset)


def merge_delta(outs: list[StepOutput]) -> RequestResult:
    """Several step outputs of one sample as one delta (a slow reader gets them batched)."""
    delta = RequestResult(outs[0].rid, [])
    for out in outs:
        delta.add(out)
    return delta
