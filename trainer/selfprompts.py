"""Prompts the target writes itself: sample its own user turns (Magpie-style).

A chat model asked to continue an open *user* turn of its chat template writes a request
like those it was tuned on, so its own user turns cover the kinds of prompts it is used
with far more widely than any template set — no downloads. A share of the user turns is
started with an opener (``OPENERS``) so reasoning and code stay represented; the rest are
open. A prompt counts when the model ends its user turn itself (stop, not length), holds at
least ``MIN_TOKENS`` tokens and is new. Deterministic for a seed: each candidate has its own
sampling seed.
"""

from __future__ import annotations

from tlt_serve import LLM, SamplingParams
from tlt_serve.models.tokenizer import Tokenizer

# One opener per candidate in turn; "" leaves the whole user turn to the model.
OPENERS = (
    "",
    "",
    "",
    "",
    "Write a Python function",
    "Solve",
    "What is",
    "Explain",
    "How do I",
    "Write a",
    "Calculate",
    "Can you",
)
MIN_TOKENS = 4
SELF_PROMPT_TOKENS = 96  # most tokens of one user turn the target writes
MARK = "\x00"  # stands for the user's text while the template is split


def user_turn_prefix(tokenizer: Tokenizer) -> str:
    """The chat template's text up to where the user's message starts."""
    text = tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=True
    )
    return str(text)[: str(text).index(MARK)]


def self_prompts(
    llm: LLM,
    tokenizer: Tokenizer,
    n: int,
    seed: int,
    max_tokens: int = SELF_PROMPT_TOKENS,
    rounds: int = 6,
) -> list[str]:
    """``n`` distinct user prompts written by the target (``llm``), in candidate order.

    Raises RuntimeError when ``rounds`` rounds of candidates do not yield ``n`` prompts."""
    prefix = user_turn_prefix(tokenizer)
    out: list[str] = []
    seen: set[str] = set()
    index = 0  # candidate number: picks the opener and the sampling seed
    for _ in range(rounds):
        need = n - len(out)
        if need <= 0:
            break
        count = need + need // 4 + 8  # ~20% are dropped (no end of turn, too short, repeats)
        candidates = range(index, index + count)
        index += count
        openers = [OPENERS[i % len(OPENERS)] for i in candidates]
        params = [
            SamplingParams(
                max_new_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed * 7_919 + i
            )
            for i in candidates
        ]
        ids = [tokenizer.encode(prefix + o) for o in openers]
        results = llm.generate(ids, params, use_tqdm=True)
        for opener, r in zip(openers, results, strict=True):
            text = opener + tokenizer.decode(r.samples[0].token_ids)
            text = text.strip()
            ended = r.samples[0].finish is not None and r.samples[0].finish.type == "stop"
            if ended and len(r.samples[0].token_ids) >= MIN_TOKENS and text not in seen:
                seen.add(text)
                out.append(text)
    if len(out) < n:
        raise RuntimeError(f"self prompts: only {len(out)} of {n} after {rounds} rounds")
    return out[:n]
