"""Constrained decoding: a request whose output must match a JSON schema (structured outputs,
forced tool calls), by xgrammar. Each such request holds a matcher; before it samples, the
tokens its grammar cannot take next are masked out; each committed token advances it.

The mask changes what is sampled, never what is reported: logprobs stay the target's
distribution before the mask (as vLLM's raw logprobs). A constrained request decodes without
speculation (drafts would need the grammar advanced and rolled back per position).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from tlt_serve.sampling_params import ParamError

if TYPE_CHECKING:
    from tlt_serve.engine.request import Request


def check_schema(schema: str, field: str) -> None:
    """A 400 naming ``field`` for a schema that is not JSON or that xgrammar cannot compile
    (checked without a tokenizer: cheap, in the front end)."""
    try:
        json.loads(schema)
    except json.JSONDecodeError as err:
        raise ParamError(field, f"is not JSON: {err}") from err
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError) as err:
        raise ParamError(field, f"cannot be compiled to a grammar: {err}") from err


class Grammars:
    """The engine's compiler (one per tokenizer): a compiled grammar per schema, cached."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self.hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None  # built on the first schema (xgrammar imported then)
        self._compiled = lru_cache(maxsize=64)(self._compile)

    def matcher(self, schema: str) -> Any:
        """A new matcher of ``schema``; ParamError where it is not a schema xgrammar takes
        (the front ends check first; the offline API does not)."""
        import xgrammar

        try:
            return xgrammar.GrammarMatcher(self._compiled(schema))
        except (RuntimeError, ValueError) as err:
            raise ParamError("json_schema", f"cannot be compiled to a grammar: {err}") from err

    def _compile(self, schema: str) -> Any:
        import xgrammar

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self.hf, vocab_size=self.vocab_size)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler.compile_json_schema(schema, any_whitespace=False)


def mask(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """logits [N, V] → a copy with what each constrained row's grammar cannot take next at
    -inf (the same tensor when no row is constrained)."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return logits
    import xgrammar

    bits = xgrammar.allocate_token_bitmask(len(reqs), logits.shape[1])  # [N, ceil(V / 32)]
    for i in rows:
        reqs[i].grammar.fill_next_token_bitmask(bits, i)
    masked = logits.clone()
    xgrammar.apply_token_bitmask_inplace(masked, bits.to(logits.device), indices=rows)
    return masked
