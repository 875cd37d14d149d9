"""Engine results → OpenAI response pieces (finish reasons, logprobs, usage)."""

from __future__ import annotations

from tlt_serve.engine.outputs import RequestResult, StepOutput
from tlt_serve.engine.request import FinishReason
from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.server.common.jobs import SampleBook, token_texts
from tlt_serve.server.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
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
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def _top_texts(self, tops: list[list[tuple[int, float]]]) -> list[list[str]]:
        """The text of every top-logprob token, decoded in one tokenizer call."""
        flat = token_texts(self.tok, [t for row in tops for t, _ in row])
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
        texts = token_texts(self.tok, ids)
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        top = []
        top_texts = self._top_texts(tops)
        for i, (text, lp) in enumerate(zip(texts, lps, strict=True)):
            entry = {text: lp}  # the sampled token is always listed, as vLLM does
            if i < len(tops):
                for t_text, (_, t_lp) in zip(top_texts[i], tops[i], strict=True):
                    entry.setdefault(t_text, t_lp)
            top.append(entry)
        return CompletionLogprobs(texts, list(lps), top, offsets), offset

    def chat(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
    ) -> ChatLogprobs:
        texts = token_texts(self.tok, ids)
        content = []
        top_texts = self._top_texts(tops)
        for i, (text, lp) in enumerate(zip(texts, lps, strict=True)):
            top: list[TopLogprob] = []
            if i < len(tops):
                for t_text, (_, t_lp) in zip(top_texts[i], tops[i], strict=True):
                    top.append(TopLogprob(t_text, t_lp, list(t_text.encode())))
            content.append(TokenLogprob(text, lp, list(text.encode()), top))
        return ChatLogprobs(content)


def merge_delta(outs: list[StepOutput]) -> RequestResult:
    """Several step outputs of one sample as one delta (a slow reader gets them batched)."""
    delta = RequestResult(outs[0].rid, [])
    for out in outs:
        delta.add(out)
    return delta
