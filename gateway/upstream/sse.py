"""``chunks(resp)``: an upstream's answer as OpenAI chunk objects, one per SSE event.

A ``text/event-stream`` answer is read line by line (WHATWG HTML, "Server-sent events": ``data:`` lines
joined by newlines, a blank line ends an event, ``:`` comments and other fields ignored); ``data: [DONE]``
ends it. Each event's data is one JSON object: a ``chat.completion.chunk`` or ``text_completion`` chunk
(OpenAI "The chat completion chunk object"). An ``application/json`` answer (an upstream that does not
stream) is turned into one equivalent chunk: ``message`` becomes ``delta``, tool calls get their ``index``.

``timed_chunks(resp, event_timeout, name)`` is ``chunks`` with a bound on the wait for each next chunk: SSE
comments (``: ping``) and blank lines are no event, so an upstream that only pings is silent.

``finish_reason`` and ``tool_call_pieces`` read members of a chunk's choice as the gateway's types.

Raises (while iterating): ``UpstreamError`` (502) when the upstream sends an error event (``{"error":
...}``), data that is not a JSON object, an event, a line or a JSON answer over 4 MiB (read no further:
memory stays bounded whatever the upstream sends), goes silent past its read timeout, or breaks the
connection; ``UpstreamTimeout`` (504) from ``timed_chunks`` past ``event_timeout``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, get_args

import httpx
import msgspec
import trio

from gateway.generation.events import FinishReason
from gateway.tools.parser import ToolCallDelta
from gateway.upstream.errors import UpstreamError, UpstreamTimeout

_MAX_EVENT_BYTES = (
    4 * 1024 * 1024
)  # one SSE event (and one line, one JSON answer); beyond it the upstream is broken
_EOL = re.compile(r"\r\n|\r|\n")  # SSE's line ends
_REASONS: frozenset[str] = frozenset(get_args(FinishReason))


def _decoded(data: str) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        raise UpstreamError("The upstream model server sent an event that is not JSON.") from None
    if not isinstance(obj, dict):
        raise UpstreamError("The upstream model server sent an event that is not a JSON object.")
    err = obj.get("error")
    if err is not None:
        msg = err.get("message") if isinstance(err, dict) else err
        text = msg[:500] if isinstance(msg, str) else "no message"
        raise UpstreamError(f"The upstream model server failed while generating: {text}")
    return obj


def _as_chunk(obj: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` / ``text_completion`` as one chunk of the same content."""
    choices = []
    for ch in obj.get("choices") or []:
        if not isinstance(ch, dict):
            continue
        out = {k: v for k, v in ch.items() if k not in ("message", "logprobs")}
        msg = ch.get("message")
        if isinstance(msg, dict):
            delta = dict(msg)
            calls = msg.get("tool_calls")
            if isinstance(calls, list):
                delta["tool_calls"] = [
                    {**c, "index": i} if isinstance(c, dict) else c for i, c in enumerate(calls)
                ]
            out["delta"] = delta
        choices.append(out)
    return {**obj, "choices": choices}


async def chunks(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The chunk objects of ``resp`` in order (see the module docstring)."""
    try:
        if resp.headers.get("content-type", "").startswith("application/json"):
            body = bytearray()
            async for piece in resp.aiter_bytes():
                body += piece
                if len(body) > _MAX_EVENT_BYTES:
                    raise UpstreamError("The upstream model server sent an answer over 4 MiB.")
            yield _as_chunk(_decoded(body.decode("utf-8", errors="replace")))
            return
        data: list[str] = []
        size = 0
        async for line in _lines(resp):
            if line == "":
                if data:
                    joined = "\n".join(data)
                    data, size = [], 0
                    if joined.strip() == "[DONE]":
                        return
                    yield _decoded(joined)
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value[1:] if value.startswith(" ") else value)
                size += len(value)
                if size > _MAX_EVENT_BYTES:
                    raise UpstreamError("The upstream model server sent an event over 4 MiB.")
        if data and "\n".join(data).strip() != "[DONE]":
            yield _decoded("\n".join(data))
    except httpx.TimeoutException:
        raise UpstreamError("The upstream model server went silent past its read timeout.") from None
    except httpx.HTTPError:
        raise UpstreamError("The upstream model server broke off the answer.") from None


async def timed_chunks(
    resp: httpx.Response, event_timeout: float, name: str
) -> AsyncIterator[dict[str, Any]]:
    """``chunks(resp)``, each within ``event_timeout`` seconds of asking for it (only the wait on the upstream
    counts, not the consumer's time between chunks). Raises ``UpstreamTimeout`` naming the model ``name``."""
    async with aclosing(chunks(resp)) as events:
        while True:
            with trio.move_on_after(event_timeout) as waited:
                chunk = await anext(events, None)
            if waited.cancelled_caught:
                raise UpstreamTimeout(
                    f"The upstream model server of '{name}' sent no event for {event_timeout:g} s "
                    "(comments do not count)."
                )
            if chunk is None:
                return
            yield chunk


async def _lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The text lines of ``resp`` without their ends (``\r\n``, ``\r`` or ``\n``; a ``\r`` that ends a piece
    waits for the next, which may start with its ``\n``). Unlike ``httpx.Response.aiter_lines``, which holds
    a line until its end arrives, a line is never held past ``_MAX_EVENT_BYTES`` characters.

    Raises:
        UpstreamError: a line longer than that (an upstream that streams without line ends).
    """
    pending = ""
    async for text in resp.aiter_text():
        pending += text
        tail = "\r" if pending.endswith("\r") else ""
        parts = _EOL.split(pending[: len(pending) - len(tail)])
        pending = parts.pop() + tail
        for line in parts:
            yield line
        if len(pending) > _MAX_EVENT_BYTES:
            raise UpstreamError("The upstream model server sent a line over 4 MiB.")
    if pending.rstrip("\r"):
        yield pending.rstrip("\r")


def finish_reason(value: object) -> FinishReason:
    """An upstream ``finish_reason`` as one of the gateway's ("function_call" -> "tool_calls"; unknown ->
    "stop")."""
    if value == "function_call":
        return "tool_calls"
    return value if isinstance(value, str) and value in _REASONS else "stop"  # type: ignore[return-value]


def tool_call_pieces(raw: object) -> list[ToolCallDelta]:
    """``delta.tool_calls`` pieces (OpenAI chunk shape) as ``ToolCallDelta``s; malformed entries dropped."""
    out: list[ToolCallDelta] = []
    for c in raw if isinstance(raw, list) else []:
        if not isinstance(c, dict) or not isinstance(c.get("index", 0), int):
            continue
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        name, args = fn.get("name"), fn.get("arguments")
        out.append(
            ToolCallDelta(
                index=c.get("index", 0),
                id=c["id"] if isinstance(c.get("id"), str) else None,
                name=name if isinstance(name, str) else None,
                arguments=args if isinstance(args, str) else "",
            )
        )
    return out
