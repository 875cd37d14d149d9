"""Tool calls in a model's output text: the formats of the chat templates served.

- ``hermes`` (Qwen2.5 / Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any text before them is content.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole answer is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` (``arguments`` too), separated by ``;``, optionally
  after ``<|python_tag|>``.

A parser is a fold over the text as it streams: ``feed`` returns what can be told so far
(content to show, calls completed), ``finish`` the rest. A whole answer is parsed by the same
fold in one step, so a streamed answer and a whole one always agree. Text that looks like a
call but does not parse as one is content: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


@dataclass
class Told:
    """What one step of the fold lets a client see."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)

    def add(self, other: Told) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolParser(Protocol):
    def feed(self, text: str) -> Told: ...

    def finish(self) -> Told: ...


def parse_all(parser: ToolParser, text: str) -> Told:
    told = parser.feed(text)
    told.add(parser.finish())
    return told


def new_parser(kind: str, name: str | None = None) -> ToolParser:
    """``kind``: a template's format, or a forced call's (``required``, ``named`` + ``name``)."""
    if kind == "hermes":
        return HermesParser()
    if kind == "llama3_json":
        return Llama3JsonParser()
    if kind in ("required", "named"):
        return ForcedParser(name)
    raise ValueError(f"unknown tool-call parser {kind!r}")


def template_parser(chat_template: str | dict[str, str] | None) -> str | None:
    """The parser a chat template's own tool format needs, or None if it shows none (a
    tokenizer may hold several named templates: any of them)."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(chat_template.values())
    if not chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return "hermes"
    if "ipython" in chat_template and "parameters" in chat_template:
        return "llama3_json"
    return None


def resolve_parser(flag: str, chat_template: str | dict[str, str] | None) -> str | None:
    """``--tool-call-parser`` (checked by ServerConfig) → the parser the server runs (None:
    tool calls are not parsed)."""
    if flag == "none":
        return None
    if flag == "auto":
        return template_parser(chat_template)
    return flag


def _call(obj: Any) -> Call | None:
    """A decoded JSON object as a call: a string ``name`` and object ``arguments`` (or
    ``parameters``, Llama's name for them)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could start ``marker`` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesParser:
    """Whitespace next to a call is not content (it is the template's layout): trailing
    whitespace is held back until other text follows it."""

    def __init__(self) -> None:
        self.buf = ""  # text not yet told: a partial marker, or an open block
        self.blank = ""  # whitespace held back
        self.calls = 0

    def feed(self, text: str) -> Told:
        self.buf += text
        told = Told()
        while True:
            start = self.buf.find(HERMES_OPEN)
            if start < 0:
                keep = _held_prefix(self.buf, HERMES_OPEN)
                told.content += self._content(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return told
            told.content += self._content(self.buf[:start])
            self.buf = self.buf[start:]
            end = self.buf.find(HERMES_CLOSE)
            if end < 0:
                return told  # an open block: wait for its end
            block = self.buf[: end + len(HERMES_CLOSE)]
            self.buf = self.buf[end + len(HERMES_CLOSE):]
            told.add(self._block(block))

    def finish(self) -> Told:
        rest, self.buf = self.buf, ""
        # a block cut off before its end (a length limit) is still a call if its JSON is whole
        told = self._block(rest) if rest.startswith(HERMES_OPEN) else Told(self._content(rest))
        if not self.calls:
            told.content += self.blank
        self.blank = ""
        return told

    def _content(self, text: str) -> str:
        """Content up to its trailing whitespace, which waits for what follows it."""
        text = self.blank + text
        body = text.rstrip()
        self.blank = text[len(body):]
        return body

    def _block(self, block: str) -> Told:
        body = block[len(HERMES_OPEN):]
        if body.endswith(HERMES_CLOSE):
            body = body[: -len(HERMES_CLOSE)]
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return Told(content=self._content(block))
        self.blank = ""
        self.calls += 1
        return Told(calls=[call])


class Llama3JsonParser:
    """Calls only where the answer starts with one (after whitespace or ``<|python_tag|>``):
    an answer in prose that quotes JSON stays prose."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "undecided"  # → "calls" | "text"
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> Told:
        self.buf += text
        if self.mode == "undecided":
            head = self.buf.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return Told()
            self.mode = "calls" if head.startswith(("{", PYTHON_TAG)) else "text"
        if self.mode == "text":
            out, self.buf = self.buf, ""
            return Told(content=out)
        return self._calls(final=False)

    def finish(self) -> Told:
        # after calls, what is left is whitespace; undecided: blank, or a partial python tag
        told = self._calls(final=True) if self.mode == "calls" else Told(content=self.buf)
        self.buf = ""
        return told

    def _calls(self, final: bool) -> Told:
        """Tell each call whose JSON object is complete; on text that is not a call, the
        rest of the answer is content."""
        told = Told()
        while True:
            rest = self.buf.lstrip()
            if rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG):].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            if not rest:
                return told
            try:
                obj, end = self.decoder.raw_decode(rest)
                call = _call(obj)
            except json.JSONDecodeError:
                if not final and rest.startswith("{"):
                    return told  # the object is still being written
                call = None
            if call is None:  # the rest of the answer is text
                self.mode = "text"
                told.content += self.buf
                self.buf = ""
                return told
            told.calls.append(call)
            self.buf = rest[end:]


class ForcedParser:
    """A forced call's answer, decoded under its schema: the arguments of function ``name``,
    or (no name: ``tool_choice`` required) a JSON list of ``{"name", "parameters"}``. Told
    whole at the end (a length limit may cut the JSON: then it is content)."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.buf = ""

    def feed(self, text: str) -> Told:
        self.buf += text
        return Told()

    def finish(self) -> Told:
        text, self.buf = self.buf, ""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return Told(content=text)
        if self.name is not None:
            calls = [_call({"name": self.name, "arguments": obj})]
        elif isinstance(obj, list):
            calls = [_call(c) for c in obj]
        else:
            calls = [None]
        if any(c is None for c in calls):
            return Told(content=text)
        return Told(calls=[c for c in calls if c is not None])
