"""Incremental detokenization and stop-string matching for one sequence.

Decoding a whole output every step is O(n^2); instead keep two offsets (the vLLM scheme):
decode ``tokens[prefix:]`` and ``tokens[prefix:read]`` and emit the difference, holding back
text that ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from typing import Any

# Context tokens decoded before the new ones so that tokenizers that drop a leading space
# (SentencePiece) or merge bytes across tokens see enough left context.
_CONTEXT = 5


class Detokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool,
        stop: tuple[str, ...] = (),
        keep_stop: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # a slow tokenizer's option; fast ones ignore it
            self.decode_kwargs["spaces_between_special_tokens"] = False
        self.stop = stop
        self.keep_stop = keep_stop  # a matched stop string stays in the text (cut after it)
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""  # output text so far (stop string excluded once matched, unless kept)
        self.emitted = 0  # characters of text already handed out

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Add one token. Returns (text safe to emit now, matched stop string or None).

        Text that could be the start of a stop string is held back until it can't be; once a
        stop string matches, ``text`` is cut before it (after it with ``keep_stop``).
        """
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], **self.decode_kwargs)
        after = decode(self.ids[self.prefix :], **self.decode_kwargs)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return "", None  # incomplete character: wait for more bytes
        old_len = len(self.text)
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        matched = self._match_stop(old_len)
        safe = len(self.text) if matched else len(self.text) - self._held_back()
        return self._emit(safe), matched

    def flush(self) -> str:
        """All text not yet emitted (call once the sequence has finished)."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out

    def _match_stop(self, old_len: int) -> str | None:
        # A stop string can straddle earlier text: search only where it could end.
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx != -1:
                self.text = self.text[: idx + len(s) if self.keep_stop else idx]
                return s
        return None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
