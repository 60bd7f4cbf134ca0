"""OpenAI streaming renderers: a run's events -> SSE ``chat.completion.chunk`` / ``text_completion`` chunks.

Bytes per event (OpenAI "The chat completion chunk object"; SSE framing in ``gateway.streaming``):

* ``Started``: 200 + SSE headers (x-ratelimit-* included). Chat: one role chunk (``delta: {role:
  "assistant", content: ""}`` for every choice), sent in the same write as the first content, or at once
  when the backend has not answered yet (``Started.waiting``) or before the first heartbeat.
* ``TextDelta`` with text or logprobs: one chunk ``delta: {content}`` (chat) or ``text`` (completions),
  ``finish_reason: null``; with tool-call pieces ``delta: {tool_calls: [{index, id, type, function: {name,
  arguments}}]}`` (id, type and name on a call's first piece only; then ``function.arguments`` fragments).
  Each ``index`` appears at most once per chunk: an event's consecutive pieces of one call are merged (id
  and name from the first, arguments concatenated), so a client reading ``tool_calls[0]`` loses nothing.
* ``Heartbeat``: the comment ``: ping``.
* ``ChoiceFinished``: one chunk with an empty delta, the ``finish_reason`` and that choice's ``timings``
  (extension, ns); ``content_filter_results`` (Azure OpenAI) when a filter cut it.
* ``Completed``: with ``stream_options.include_usage`` a chunk with ``choices: []``, ``usage`` and
  ``timings``; then ``data: [DONE]``.
"""

from __future__ import annotations

import msgspec

from gateway.generation.events import ChoiceFinished, Completed, Event, Heartbeat, Started, TextDelta
from gateway.generation.request import GenerationRequest
from gateway.openai.logprobs import TokenNames, chat_logprobs, completion_logprobs
from gateway.openai.renderer import OpenAIRenderer, usage_out
from gateway.openai.schemas import (
    ChatChunk,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    Delta,
    FunctionDelta,
    ToolCallChunk,
    UsageOut,
    encode,
)
from gateway.streaming import ResponseWriter


class _SSERenderer(OpenAIRenderer):
    """The event loop shared by both streams; subclasses build the chunks."""

    def __init__(self, names: TokenNames, req: GenerationRequest, w: ResponseWriter) -> None:
        super().__init__(names, req, w)
        self.prefix = b""  # pre-framed bytes that travel with the next write (the chat role chunk)

    def opening(self) -> bytes:
        return b""

    def delta(self, ev: TextDelta) -> bytes:
        raise NotImplementedError

    def chunk(
        self, index: int | None, *, usage: UsageOut | None = None, timings: dict[str, int] | None = None
    ) -> ChatChunk | Completion:
        """A chunk with one empty choice that finished (``index``), or none (None: the usage chunk)."""
        raise NotImplementedError

    def finish(self, ev: ChoiceFinished) -> bytes:
        chunk = self.chunk(ev.index, timings=ev.timings)
        if ev.reason == "content_filter" and ev.content_filter_results:
            obj = msgspec.to_builtins(chunk)
            obj["choices"][0]["content_filter_results"] = ev.content_filter_results
            return encode(obj)
        return encode(chunk)

    async def _send(self, data: bytes) -> None:
        await self.w.raw(self.prefix + b"data: " + data + b"\n\n")
        self.prefix = b""

    async def _flush_prefix(self) -> None:
        if self.prefix:
            await self.w.raw(self.prefix)
            self.prefix = b""

    async def emit(self, event: Event) -> None:
        if isinstance(event, TextDelta):
            if event.text or event.logprobs or event.tool_calls:
                await self._send(self.delta(event))
        elif isinstance(event, ChoiceFinished):
            self.reasons[event.index] = event.reason
            await self._send(self.finish(event))
        elif isinstance(event, Heartbeat):
            await self._flush_prefix()
            await self.w.ping()
        elif isinstance(event, Started):
            await self.w.start(event.headers)
            self.prefix = self.opening()
            if event.waiting:
                await self._flush_prefix()
        elif isinstance(event, Completed):
            if self.include_usage:
                usage = usage_out(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
                await self.w.event(encode(self.chunk(None, usage=usage, timings=event.timings)))
            await self.w.done()


class ChatStream(_SSERenderer):
    """``stream: true`` on /v1/chat/completions."""

    def opening(self) -> bytes:
        role = [ChunkChoice(i, Delta(role="assistant", content=""), None, None) for i in range(self.n)]
        return b"data: " + encode(self.chat_chunk(role)) + b"\n\n"

    def delta(self, ev: TextDelta) -> bytes:
        lp = None
        if ev.logprobs is not None:
            lp = ChoiceLogprobs(chat_logprobs(self.names, ev.logprobs, self.k))
        if ev.tool_calls:
            calls: list[ToolCallChunk] = []
            for d in ev.tool_calls:
                if calls and calls[-1].index == d.index:  # one entry per call: fragments concatenated
                    calls[-1].function.arguments = (calls[-1].function.arguments or "") + d.arguments
                    continue
                calls.append(
                    ToolCallChunk(
                        d.index,
                        FunctionDelta(name=d.name, arguments=d.arguments),
                        id=d.id,
                        type="function" if d.id is not None else None,
                    )
                )
            delta = Delta(content=ev.text or None, tool_calls=calls)
        else:
            delta = Delta(content=ev.text)
        return encode(self.chat_chunk([ChunkChoice(ev.index, delta, lp, None)]))

    def chunk(
        self, index: int | None, *, usage: UsageOut | None = None, timings: dict[str, int] | None = None
    ) -> ChatChunk:
        choices = [] if index is None else [ChunkChoice(index, Delta(), None, self.reasons[index])]
        return self.chat_chunk(choices, usage=usage, timings=timings)


class CompletionStream(_SSERenderer):
    """``stream: true`` on /v1/completions (legacy): ``text_completion`` chunks; logprobs ``text_offset``
    counts the characters already sent for the choice."""

    def __init__(self, names: TokenNames, req: GenerationRequest, w: ResponseWriter) -> None:
        super().__init__(names, req, w)
        self.offsets = [0] * self.n

    def delta(self, ev: TextDelta) -> bytes:
        lp = None
        if ev.logprobs is not None:
            lp = completion_logprobs(self.names, ev.logprobs, self.k, self.offsets[ev.index], ev.offsets)
        self.offsets[ev.index] += len(ev.text)
        return encode(self.completion([CompletionChoice(ev.index, ev.text, lp, None)]))

    def chunk(
        self, index: int | None, *, usage: UsageOut | None = None, timings: dict[str, int] | None = None
    ) -> Completion:
        choices = [] if index is None else [CompletionChoice(index, "", None, self.reasons[index])]
        return self.completion(choices, usage=usage, timings=timings)
