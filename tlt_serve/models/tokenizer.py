"""The target's tokenizer plus what the engine needs from it (eos ids, chat template)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Tokenizer:
    hf: Any  # transformers PreTrainedTokenizerFast
    eos_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Chat messages (and the tools offered) → prompt token ids, the assistant turn opened.
        ``template_kwargs``: variables the template reads (Qwen3's ``enable_thinking``).

        Raises ValueError (no template, or the template rejected the messages)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True,
                **(template_kwargs or {}),
            )
        except TemplateError as err:  # e.g. a template that raises on an unexpected role order
            raise ValueError(f"chat template failed: {err}") from err
        return self.encode(text)


def load_tokenizer(path: str | Path) -> Tokenizer:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path))
    return Tokenizer(hf=hf, eos_ids=frozenset(_eos_ids(Path(path), hf)))


def _eos_ids(path: Path, hf: Any) -> set[int]:
    ids: set[int] = set()
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if hf.eos_token_id is not None:
        ids.add(int(hf.eos_token_id))
    return ids
