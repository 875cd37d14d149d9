"""A chat request's conversation and tools → what the chat template renders, and whether the
answer is parsed for tool calls."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from tlt_serve.sampling_params import ParamError
from tlt_serve.server.openai.protocol import ChatMessage, ChatReq, NamedToolChoice, ToolDef


@dataclass(frozen=True)
class ToolUse:
    """``schemas``: the tools as sent, for the template; ``parser``: the tool-call format the
    answer is parsed with (None: all of it is content)."""

    schemas: list[dict[str, Any]] | None = None
    parser: str | None = None
    parallel: bool = True


def tool_use(req: ChatReq, parser: str | None) -> ToolUse:
    """Check ``tools`` and ``tool_choice``; ``parser``: the server's (None: it parses none)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ParamError("tool_choice", "needs tools")
        return ToolUse()
    names = _tool_names(req.tools)
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise ParamError("tool_choice.type", f"must be 'function', got {choice.type!r}")
        if choice.function.name not in names:
            raise ParamError("tool_choice.function.name",
                             f"{choice.function.name!r} is not among the tools")
        raise ParamError("tool_choice", "a named function needs constrained decoding, which "
                         "this server does not run; use 'auto'")
    if choice == "none":
        return ToolUse(req.tools)  # rendered (as vLLM does), never parsed
    if choice == "required":
        raise ParamError("tool_choice", "'required' needs constrained decoding, which this "
                         "server does not run; use 'auto'")
    if choice != "auto":
        raise ParamError("tool_choice", f"must be 'none', 'auto', 'required' or a named "
                         f"function, got {choice!r}")
    if parser is None:
        raise ParamError("tool_choice", "'auto' needs a tool-call parser: this model's chat "
                         "template shows no tool-call format the server knows; start it with "
                         "--tool-call-parser hermes|llama3_json")
    return ToolUse(req.tools, parser, req.parallel_tool_calls is not False)


def _tool_names(tools: list[dict[str, Any]]) -> set[str]:
    names: set[str] = set()
    for i, raw in enumerate(tools):
        try:
            tool = msgspec.convert(raw, ToolDef)
        except msgspec.ValidationError as err:
            raise ParamError(f"tools[{i}]", str(err)) from err
        if tool.type != "function":
            raise ParamError(f"tools[{i}].type", f"must be 'function', got {tool.type!r}")
        name = tool.function.name
        if not name:
            raise ParamError(f"tools[{i}].function.name", "is empty")
        if name in names:
            raise ParamError(f"tools[{i}].function.name", f"{name!r} is given twice")
        names.add(name)
    return names


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat templates read it: text parts joined, an assistant's calls with
    their arguments as objects (templates write them with ``tojson``), a tool result's call id."""
    if not messages:
        raise ParamError("messages", "is empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise ParamError(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p.text for p in content)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ParamError(f"messages[{i}].tool_calls", "only an assistant makes calls")
            msg["tool_calls"] = [_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    if call.type != "function":
        raise ParamError(f"{where}.type", f"must be 'function', got {call.type!r}")
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError as err:
        raise ParamError(f"{where}.function.arguments", f"is not JSON: {err}") from err
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out
