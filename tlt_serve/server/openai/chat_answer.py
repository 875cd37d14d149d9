"""A chat completion's answer, whole or streamed: the message, its tool calls parsed from the
text as the server's tool-call format writes them."""

from __future__ import annotations

from tlt_serve.engine.outputs import RequestResult, StepOutput
from tlt_serve.engine.request import FinishReason
from tlt_serve.server.common.jobs import Job, SampleBook
from tlt_serve.server.common.state import ServerState
from tlt_serve.server.openai.answer import Answer, event
from tlt_serve.server.openai.chat_inputs import ToolUse
from tlt_serve.server.openai.format import (
    finish_str,
    latest_version,
    merge_delta,
    stop_reason,
    usage,
)
from tlt_serve.server.openai.protocol import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatMessageOut,
    ChatReq,
    ChatResponse,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tlt_serve.server.openai.tools import Call, ToolParser, new_parser, parse_all


class ChatAnswer(Answer):
    def __init__(self, st: ServerState, req: ChatReq, jobs: list[Job], tools: ToolUse) -> None:
        opts = req.stream_options
        super().__init__(st, "chatcmpl", jobs, bool(opts and opts.include_usage), req)
        self.tools = tools
        self.parsers: dict[int, ToolParser] = {}  # per streamed choice
        self.calls_told: dict[int, int] = {}

    def _parser(self, k: int) -> ToolParser | None:
        if self.tools.parser is None:
            return None
        if k not in self.parsers:
            self.parsers[k] = new_parser(self.tools.parser, self.tools.name)
        return self.parsers[k]

    def _calls(self, k: int, calls: list[Call]) -> list[tuple[int, ToolCall]]:
        """The calls of choice ``k`` told now, numbered on from those told before (with
        ``parallel_tool_calls`` false, only its first)."""
        start = self.calls_told.get(k, 0)
        if not self.tools.parallel:
            calls = calls[: max(0, 1 - start)]
        self.calls_told[k] = start + len(calls)
        return [
            (n, ToolCall(f"call-{self.id}-{k}-{n}", FunctionCall(c.name, c.arguments)))
            for n, c in enumerate(calls, start)
        ]

    def _finish(self, k: int, fin: FinishReason | None) -> str | None:
        """``tool_calls`` where the answer ended on its own after making calls (a named
        function's call ends with ``stop``, as OpenAI's)."""
        named = self.tools.parser == "named"
        if fin is not None and fin.type == "stop" and self.calls_told.get(k, 0) and not named:
            return "tool_calls"
        return finish_str(fin)

    def response(self, book: SampleBook) -> ChatResponse:
        choices = []
        for k, r in enumerate(book.samples):
            params = book.job(k).params
            logprobs = (
                self.lp.chat(r.token_ids, r.logprobs, r.top_logprobs) if params.logprobs else None
            )
            parser = self._parser(k)
            if parser is None:
                message = ChatMessageOut("assistant", r.text)
            else:
                told = parse_all(parser, r.text)
                calls = [call for _, call in self._calls(k, told.calls)]
                content = told.content if told.content or not calls else None
                message = ChatMessageOut("assistant", content, calls)
            choice = ChatChoice(
                k, message, logprobs, self._finish(k, r.finish),
                stop_reason(r.finish, params, self.eos),
            )
            if self.token_ids:
                choice.token_ids = list(r.token_ids)
            choices.append(choice)
        out = ChatResponse(self.id, self.created, self.st.model_name, choices,
                           latest_version(book), usage=usage(book))
        if self.token_ids:
            out.prompt_token_ids = list(book.jobs[0].prompt_ids)
        out.prompt_logprobs = self._prompt_logprobs(book.samples[0])
        return out

    def opening(self, book: SampleBook) -> list[bytes]:
        """The role announcement for every choice, before any content (as OpenAI does)."""
        chunks = []
        for k in range(len(book.samples)):
            choice = ChatChunkChoice(k, ChatDelta(role="assistant", content=""), None, None)
            chunk = ChatChunk(self.id, self.created, self.st.model_name, [choice],
                              self.st.bridge.weight_version, usage=self._usage_field())
            if self.token_ids and k == 0:
                chunk.prompt_token_ids = list(book.jobs[0].prompt_ids)
            chunks.append(event(chunk))
        return chunks

    def _delta(self, k: int, d: RequestResult) -> ChatDelta:
        parser = self._parser(k)
        if parser is None:
            return ChatDelta(content=d.text)
        told = parser.feed(d.text)
        if d.finish is not None:
            told.add(parser.finish())
        delta = ChatDelta(content=told.content) if told.content else ChatDelta()
        calls = self._calls(k, told.calls)
        if calls:
            delta.tool_calls = [DeltaToolCall(i, c.id, c.function) for i, c in calls]
        return delta

    def chunk(self, book: SampleBook, k: int, new: list[StepOutput]) -> bytes | None:
        d, params = merge_delta(new), book.job(k).params
        delta = self._delta(k, d)
        told = bool(delta.content) or bool(delta.tool_calls)  # UNSET is false
        if not (told or d.finish or params.logprobs or self.token_ids):
            return None  # nothing a client could see (text held back)
        logprobs = None
        if params.logprobs:
            logprobs = self.lp.chat(d.token_ids, d.logprobs, d.top_logprobs)
        choice = ChatChunkChoice(
            k, delta, logprobs, self._finish(k, d.finish),
            stop_reason(d.finish, params, self.eos),
        )
        if self.token_ids:
            choice.token_ids = list(d.token_ids)
        d.prompt_ids = book.samples[k].prompt_ids
        out = ChatChunk(self.id, self.created, self.st.model_name, [choice], d.weight_version,
                        usage=self._usage_field())
        if k == 0:
            out.prompt_logprobs = self._prompt_logprobs(d)
        return event(out)

    def closing(self, book: SampleBook) -> bytes | None:
        if not self.include_usage:
            return None
        return event(ChatChunk(self.id, self.created, self.st.model_name, [],
                                latest_version(book), usage=usage(book)))
