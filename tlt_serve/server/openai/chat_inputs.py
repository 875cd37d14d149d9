"""A chat request's conversation and tools → what the chat template renders, and whether the
answer is parsed for tool calls."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from tlt_serve.engine.grammar import check_schema
from tlt_serve.sampling_params import ParamError
from tlt_serve.server.openai.protocol import ChatMessage, ChatReq, NamedToolChoice, ToolDef


@dataclass(frozen=True)
class ToolUse:
    """``schemas``: the tools as sent, for the template; ``parser``: how the answer is read
    for calls (a template's format, ``required``: a JSON list of calls, ``named``: the
    arguments of ``name``; None: all of it is content); ``json_schema``: what constrains the
    answer (a forced call)."""

    schemas: list[dict[str, Any]] | None = None
    parser: str | None = None
    name: str | None = None
    parallel: bool = True
    json_schema: str | None = None


def tool_use(req: ChatReq, parser: str | None) -> ToolUse:
    """Check ``tools`` and ``tool_choice``; ``parser``: the server's (None: it parses none)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ParamError("tool_choice", "needs tools")
        return ToolUse()
    tools = _tools(req.tools)
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise ParamError("tool_choice.type", f"must be 'function', got {choice.type!r}")
        name = choice.function.name
        if name not in tools:
            raise ParamError("tool_choice.function.name", f"{name!r} is not among the tools")
        return ToolUse(req.tools, "named", name, parallel, json.dumps(_parameters(tools[name])))
    if choice == "none":
        return ToolUse(req.tools)  # rendered (as vLLM does), never parsed
    if choice == "required":
        return ToolUse(req.tools, "required", None, parallel, _calls_schema(tools, parallel))
    if choice != "auto":
        raise ParamError("tool_choice", f"must be 'none', 'auto', 'required' or a named "
                         f"function, got {choice!r}")
    if parser is None:
        raise ParamError("tool_choice", "'auto' needs a tool-call parser: this model's chat "
                         "template shows no tool-call format the server knows; start it with "
                         "--tool-call-parser hermes|llama3_json")
    return ToolUse(req.tools, parser, None, parallel)


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def _calls_schema(tools: dict[str, ToolDef], parallel: bool) -> str:
    """A JSON list of one or more ``{"name", "parameters"}`` calls of the tools (the shape
    vLLM constrains ``required`` to)."""
    call = [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [name]},
                        "parameters": _parameters(tool)},
         "required": ["name", "parameters"]}
        for name, tool in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def answer_schema(req: ChatReq, tools: ToolUse) -> str | None:
    """What constrains the answer: a forced call's schema, or ``response_format``'s."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return tools.json_schema
    if tools.json_schema is not None:
        raise ParamError("response_format", "cannot be combined with a forced tool call")
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    if fmt.type != "json_schema":
        raise ParamError("response_format.type", "must be 'text', 'json_object' or "
                         f"'json_schema', got {fmt.type!r}")
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise ParamError("response_format.json_schema.schema", "is required")
    schema = json.dumps(fmt.json_schema.schema)
    check_schema(schema, "response_format.json_schema.schema")
    return schema


def _tools(tools: list[dict[str, Any]]) -> dict[str, ToolDef]:
    """The tools by name, each checked."""
    names: dict[str, ToolDef] = {}
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
        if tool.function.parameters is not None:
            check_schema(json.dumps(tool.function.parameters), f"tools[{i}].function.parameters")
        names[name] = tool
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
