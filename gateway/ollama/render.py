"""Ollama renderers: the events of one generation run (``gateway.generation.events``) written as Ollama's
NDJSON stream or as one JSON object, through ``gateway.streaming.ResponseWriter``.

Shapes follow Ollama's docs/api.md (https://github.com/ollama/ollama/blob/main/docs/api.md), "Generate a
completion" and "Generate a chat completion", and what the official ``ollama`` Python client parses:

    piece  {"model", "created_at", "message": {"role": "assistant", "content"} | "response", "done": false}
    call   a chat piece whose message is {"role": "assistant", "content": "", "tool_calls": [CALL]}
    final  the piece with "done": true, "done_reason" (stop | length | content_filter) and the statistics
    error  {"error": message, "type": OpenAI error type, "code": OpenAI error code}

    CALL   {"id": "call_...", "function": {"name": str, "arguments": <JSON object>}} (Ollama's
           ``Message.ToolCall``; "Chat request (with tools)")

A stream (``application/x-ndjson``) is one piece per text delta of choice 0, one call piece per tool call
once the call is complete (the next call began, or the choice ended), then the final object (its text
empty); a non-stream answer is the final object holding the whole text, and ``message.tool_calls`` when
the model called tools. A call whose arguments are not a JSON object (cut off by ``num_predict``) is left
out (``gateway.ollama.tools.ollama_call``). done_reason is "stop" for an answer that ended in tool calls,
as in Ollama (OpenAI's "tool_calls"). Each object is compact JSON and one line (``\\n``-terminated). An
error before the answer started is the error object with the error's HTTP status and headers; after it,
one final error line ends the stream.

Statistics, integers (durations in nanoseconds, from ``Completed``):
    total_duration        gateway arrival -> end of the run
    load_duration         0: the model is always loaded
    prompt_eval_count     prompt tokens (== OpenAI usage.prompt_tokens)
    prompt_eval_duration  backend prefill time, at most total_duration
    eval_count            generated tokens (== usage.completion_tokens)
    eval_duration         backend decode time, at most total_duration - prompt_eval_duration
  extensions (not in Ollama):
    prompt_eval_cached_count  prompt tokens served from the prefix cache
    queue_duration            backend queue time
    draft_tokens              speculative decoding: draft tokens proposed for the answer
    accepted_tokens           of those, the ones the model's own sampling confirmed (<= draft_tokens)
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec
from starlette.responses import JSONResponse, Response

from gateway.errors import APIError
from gateway.generation.events import ChoiceFinished, Completed, Event, Started, TextDelta
from gateway.ollama.tools import ollama_call
from gateway.streaming import ResponseWriter
from gateway.tools.assemble import ToolCallAssembler

Kind = Literal["chat", "generate"]

NDJSON_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"application/x-ndjson"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx would otherwise buffer the stream
]

_json = msgspec.json.Encoder()


def line(obj: dict[str, Any]) -> bytes:
    """One NDJSON line: compact JSON (UTF-8, non-ASCII unescaped) + ``\\n``."""
    return _json.encode(obj) + b"\n"


def now_rfc3339() -> str:
    """Current UTC time as Ollama writes ``created_at`` (RFC 3339, microseconds, ``Z``)."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def error_body(exc: APIError) -> dict[str, Any]:
    """``exc`` in Ollama's shape: ``{"error": message, "type", "code"}`` (the client reads ``error``)."""
    return exc.ollama_body()


def error_response(exc: APIError) -> Response:
    """``exc`` answered before any generation began: Ollama's error object, the error's status and headers."""
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers or None)


def piece(kind: Kind, model: str, text: str, done: bool) -> dict[str, Any]:
    """One answer object without statistics: ``message`` (chat) or ``response`` (generate) holds ``text``."""
    obj: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
    if kind == "chat":
        obj["message"] = {"role": "assistant", "content": text}
    else:
        obj["response"] = text
    obj["done"] = done
    return obj


class Stats(msgspec.Struct, frozen=True, kw_only=True):
    """The final object's statistics (see the module docstring; ns and token counts)."""

    total_duration: int
    load_duration: int = 0
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int
    prompt_eval_cached_count: int
    queue_duration: int
    draft_tokens: int = 0
    accepted_tokens: int = 0


def final_stats(done: Completed, t_arrival: float) -> Stats:
    """Statistics from ``done``; ``total_duration`` is measured from ``t_arrival`` (``time.perf_counter()``)
    when the run gave none. Durations are clamped so that prompt_eval + eval <= total always holds."""
    t = done.timings
    total = t.get("total_duration") or max(0, int((time.perf_counter() - t_arrival) * 1e9))
    prompt_eval = min(max(0, t.get("prompt_eval_duration", 0)), total)
    return Stats(
        total_duration=total,
        prompt_eval_count=done.prompt_tokens,
        prompt_eval_duration=prompt_eval,
        eval_count=done.completion_tokens,
        eval_duration=min(max(0, t.get("eval_duration", 0)), total - prompt_eval),
        prompt_eval_cached_count=done.cached_tokens,
        queue_duration=max(0, t.get("queue_duration", 0)),
        draft_tokens=max(0, t.get("draft_tokens", 0)),
        accepted_tokens=max(0, t.get("accepted_tokens", 0)),
    )


class OllamaRenderer:
    """Base of the two renderers (an ``EventSink`` plus ``fail``): the answer's shape and choice 0's state.

    Args:
        writer: the response writer of the ``CallResponse`` running the request.
        kind: "chat" (``message``) or "generate" (``response``).
        model: the model name the client asked for (echoed in every object).
        t_arrival: ``time.perf_counter()`` at the request's arrival.
    """

    def __init__(self, writer: ResponseWriter, *, kind: Kind, model: str, t_arrival: float) -> None:
        self.writer = writer
        self.kind = kind
        self.model = model
        self.t_arrival = t_arrival
        self.headers: dict[str, str] = {}
        self.reason = "stop"
        self.calls = ToolCallAssembler()  # choice 0's tool calls
        self.calls_sent = 0  # calls handed to ``tool_calls`` so far

    def ready_calls(self, finished: bool) -> list[dict[str, Any]]:
        """Ollama CALLs complete since the last time (all of them once ``finished``)."""
        calls = self.calls.calls()
        end = len(calls) if finished else max(0, len(calls) - 1)
        out = [c for c in map(ollama_call, calls[self.calls_sent : end]) if c is not None]
        self.calls_sent = max(self.calls_sent, end)
        return out

    def final(self, text: str, done: Completed, calls: list[dict[str, Any]] | None = None) -> bytes:
        """The final object's line: ``text`` (and ``calls``), done, done_reason and the statistics."""
        obj = piece(self.kind, self.model, text, True)
        if calls:
            obj["message"]["tool_calls"] = calls
        obj["done_reason"] = self.reason
        obj.update(msgspec.structs.asdict(final_stats(done, self.t_arrival)))
        return line(obj)

    async def emit(self, event: Event) -> None:
        if isinstance(event, Started):
            self.headers = dict(event.headers)
            await self.started()
        elif isinstance(event, TextDelta):
            if event.index == 0 and event.text:
                await self.text(event.text)
            if event.index == 0 and event.tool_calls:
                self.calls.add(event.tool_calls)
                await self.tool_calls(self.ready_calls(False))
        elif isinstance(event, ChoiceFinished):
            if event.index == 0:
                self.reason = "stop" if event.reason == "tool_calls" else event.reason
                if self.calls:
                    await self.tool_calls(self.ready_calls(True))
        elif isinstance(event, Completed):
            await self.completed(event)
        # Heartbeat: NDJSON has no comment line; Ended: bookkeeping only

    async def started(self) -> None:
        """The answer may start (``self.headers`` known)."""

    async def text(self, text: str) -> None:
        """New text of choice 0 (never empty)."""

    async def tool_calls(self, calls: list[dict[str, Any]]) -> None:
        """Tool calls of choice 0 now complete (Ollama CALLs; may be empty)."""

    async def completed(self, done: Completed) -> None:
        """The run succeeded: send the final object."""

    async def fail(self, exc: APIError) -> None:
        """Report ``exc``: the error object with its status before the answer started, else an error line."""
        if self.writer.finished:
            return
        if self.writer.started:
            await self.writer.end(line(error_body(exc)))
        else:
            await self.writer.json(exc.status, line(error_body(exc)), exc.headers)


class NdjsonStream(OllamaRenderer):
    """``"stream": true`` (Ollama's default): the headers at ``Started``, a line per delta, the final line."""

    async def started(self) -> None:
        await self.writer.start(self.headers, media=NDJSON_HEADERS)

    async def text(self, text: str) -> None:
        await self.writer.start(self.headers, media=NDJSON_HEADERS)  # no-op once started
        await self.writer.raw(line(piece(self.kind, self.model, text, False)))

    async def tool_calls(self, calls: list[dict[str, Any]]) -> None:
        for call in calls:
            obj = piece(self.kind, self.model, "", False)
            obj["message"]["tool_calls"] = [call]
            await self.writer.start(self.headers, media=NDJSON_HEADERS)
            await self.writer.raw(line(obj))

    async def completed(self, done: Completed) -> None:
        await self.writer.start(self.headers, media=NDJSON_HEADERS)
        await self.writer.end(self.final("", done))


class JsonAnswer(OllamaRenderer):
    """``"stream": false``: the text gathered, one JSON object (200) at the end."""

    def __init__(self, writer: ResponseWriter, *, kind: Kind, model: str, t_arrival: float) -> None:
        super().__init__(writer, kind=kind, model=model, t_arrival=t_arrival)
        self.parts: list[str] = []
        self.call_list: list[dict[str, Any]] = []

    async def text(self, text: str) -> None:
        self.parts.append(text)

    async def tool_calls(self, calls: list[dict[str, Any]]) -> None:
        self.call_list.extend(calls)

    async def completed(self, done: Completed) -> None:
        body = self.final("".join(self.parts), done, self.call_list)
        await self.writer.json(200, body, self.headers)


def renderer(
    writer: ResponseWriter, *, stream: bool, kind: Kind, model: str, t_arrival: float
) -> OllamaRenderer:
    """The renderer for a request: ``NdjsonStream`` when ``stream``, else ``JsonAnswer``."""
    cls = NdjsonStream if stream else JsonAnswer
    return cls(writer, kind=kind, model=model, t_arrival=t_arrival)
