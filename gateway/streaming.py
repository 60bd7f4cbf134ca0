"""ASGI plumbing for generation responses: disconnect watching, SSE framing, late status choice.

``CallResponse(produce)`` is a Starlette-compatible response whose ``__call__``
runs ``produce(writer)`` next to a task that waits for ``http.disconnect``:
when the client goes away the producer is cancelled, so its ``with
handle:`` block exits and the backend request is aborted within one engine
step, which frees its KV blocks. The producer decides the status late: until
it sends the first SSE event it can still answer with a plain JSON error and a
4xx/5xx status (an over-long prompt or a bad parameter is a 400 before any SSE
byte); afterwards an error is one ``data: {"error": ...}`` event, then
``data: [DONE]``, then the response ends (the connection is never left open).

Once the last message of the response is handed to the server (``ResponseWriter.ending``), an
``http.disconnect`` is no longer the client leaving: the server sends one when the response is complete
(hypercorn does so while the last body message is being written). The producer is then not cancelled, so
a request that was answered in full keeps its outcome (200, its finish reason) in the logs, metrics and
ledger.

SSE framing follows the WHATWG HTML spec, "Server-sent events"
(https://html.spec.whatwg.org/multipage/server-sent-events.html): ``data:``
lines, a blank line per event, ``:``-comments as heartbeats. Each event is
one ASGI ``http.response.body`` message, which hypercorn writes (flushes)
at once. Headers: ``Cache-Control: no-cache`` and ``X-Accel-Buffering: no``
(nginx would otherwise buffer the stream and deliver it all at once).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
import trio

from gateway.errors import APIError, InternalError
from gateway.middleware.asgi import Message, Receive, Scope, Send
from gateway.middleware.drain import CUT_KEY, shutting_down

log = logging.getLogger("gateway")

SSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
CUT_WRITE_S = 1.0  # seconds the error that ends a response cut by the drain timeout may take to send

_json = msgspec.json.Encoder()


def _hdrs(headers: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (headers or {}).items()]


class ResponseWriter:
    """What a producer uses to answer: ``json`` (once, before any event) or SSE ``start``/``event``/``done``."""

    __slots__ = ("_send", "started", "ending", "finished", "status")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False  # response headers sent
        self.ending = False  # the last message of the response is being (or was) sent
        self.finished = False
        self.status: int | None = None

    async def json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        """Send a complete JSON response (``body`` is bytes or a msgspec-encodable object)."""
        data = body if isinstance(body, (bytes, bytearray)) else _json.encode(body)
        self.started = True
        self.ending = True
        self.status = status
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())] + _hdrs(
            headers
        )
        await self._send({"type": "http.response.start", "status": status, "headers": hdrs})
        await self._send({"type": "http.response.body", "body": bytes(data), "more_body": False})
        self.finished = True

    async def error(self, exc: APIError) -> None:
        """Report ``exc``: a JSON error response if nothing was sent yet, else an SSE error event + [DONE]."""
        if self.finished:
            return
        if not self.started:
            await self.json(exc.status, exc.body(), exc.headers)
        else:
            await self.event(_json.encode(exc.body()))
            await self.done()

    async def start(
        self, headers: dict[str, str] | None = None, *, media: list[tuple[bytes, bytes]] = SSE_HEADERS
    ) -> None:
        """Send 200 + ``media`` headers (SSE by default; e.g. NDJSON ones) + ``headers`` (idempotent)."""
        if self.started:
            return
        self.started = True
        self.status = 200
        await self._send({"type": "http.response.start", "status": 200, "headers": media + _hdrs(headers)})

    async def end(self, data: bytes = b"") -> None:
        """Send ``data`` as the last bytes of a body its caller frames (NDJSON: no ``[DONE]``)."""
        if self.finished:
            return
        self.finished = self.ending = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def event(self, data: bytes) -> None:
        """Send one ``data:`` event (``data`` is the JSON payload, no newlines)."""
        await self._send(
            {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}
        )

    async def raw(self, data: bytes) -> None:
        """Send pre-framed SSE bytes (several events at once, or a comment)."""
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def ping(self) -> None:
        """Heartbeat comment (ignored by SSE parsers; keeps proxies and clients from timing out)."""
        await self._send({"type": "http.response.body", "body": PING, "more_body": True})

    async def done(self) -> None:
        """``data: [DONE]`` and end of the response body."""
        if self.finished:
            return
        self.finished = self.ending = True
        await self._send({"type": "http.response.body", "body": DONE, "more_body": False})


class CallResponse:
    """ASGI response running ``produce(writer)``; cancelled when the client disconnects before the last
    message of the response was handed to the server (``disconnected`` is then True), or when the drain
    timeout cuts the requests still running (the drain gate's event in ``scope[CUT_KEY]``; ``cut`` is
    then True and the answer is ended with ``fail(writer, 503 server_shutting_down)``: an error event and
    ``[DONE]`` by default, the API's own error when the producer gave ``fail``).

    ``produce`` must answer through the writer. An ``APIError`` escaping it is reported by
    ``writer.error``; any other exception becomes a 500 (or an error event mid-stream).
    """

    def __init__(
        self,
        produce: Callable[[ResponseWriter], Awaitable[None]],
        fail: Callable[[ResponseWriter, APIError], Awaitable[None]] | None = None,
    ) -> None:
        self.produce = produce
        self.fail = fail
        self.disconnected = False
        self.cut = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = ResponseWriter(send)
        cutting = scope.get(CUT_KEY)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, receive, writer, nursery.cancel_scope)
            if isinstance(cutting, trio.Event):
                nursery.start_soon(self._watch_cut, cutting, nursery.cancel_scope)
            try:
                await self.produce(writer)
            except APIError as exc:
                await writer.error(exc)
            except Exception:  # noqa: BLE001 - never leave a client hanging
                log.exception("generation failed")
                await writer.error(InternalError("The server had an error while processing your request."))
            finally:
                nursery.cancel_scope.cancel()
        if self.cut and not writer.finished and not self.disconnected:
            with trio.move_on_after(CUT_WRITE_S):  # a client that does not read cannot hold the stop
                await (self.fail or ResponseWriter.error)(writer, shutting_down())
        if not writer.finished and not self.disconnected:
            # produce() returned without answering: close the response properly
            if writer.started:
                await writer.done()

    async def _watch_cut(self, cutting: trio.Event, scope: trio.CancelScope) -> None:
        await cutting.wait()
        self.cut = True
        scope.cancel()

    async def _watch(self, receive: Receive, writer: ResponseWriter, scope: trio.CancelScope) -> None:
        while True:
            msg: Message = await receive()
            if msg["type"] == "http.disconnect":
                if not writer.ending:  # else: the server's end-of-response notice, not the client leaving
                    self.disconnected = True
                    scope.cancel()
                return
