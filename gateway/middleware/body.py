"""``BodyGuard``: the ASGI middleware that bounds how a request body arrives and what is left of it unread.

* **Read timeout.** A request that announces a body (``Content-Length`` > 0 or ``Transfer-Encoding``) must
  deliver all of it within ``timeout`` seconds of its headers (``http.body_timeout``; 0: no bound). A read
  past that raises :class:`~gateway.errors.RequestTimeout` in whoever reads (408 ``request_timeout``,
  ``Connection: close``), so a client trickling bytes holds neither a handler nor its connection.
  Source: RFC 9110 section 15.5.9 (408 Request Timeout); the server closes the connection after it.
* **Drain before the end of a response.** When a response ends while its body is still unread (a 413 decided
  on ``Content-Length`` or counted while reading, a 401 before the body was read), the last response message
  is held: what it carries is sent, then the rest of the body is read and dropped, at most
  :data:`DRAIN_BYTES` bytes for :data:`DRAIN_SECONDS`, and the response ends. A client that writes its whole
  body before it reads (``httpx``, the OpenAI SDK) thus finishes writing and reads the answer instead of
  hanging on a full socket, or getting a reset, and the server-side request ends. The drain stops at once
  when the server begins to stop (``stopping``, set by :meth:`DrainGate.idle
  <gateway.middleware.drain.DrainGate.idle>`), so a drain never holds a shutdown; a body announced larger
  than the drain budget is not drained at all. In both cases hypercorn closes the connection after the
  response (RFC 9112 section 9.6: a server that does not read the whole body closes).

Headers are hypercorn's to bound: its keep-alive timer runs until a request's headers are complete and
``h11_max_incomplete_size`` (16 KiB) caps their size.
"""

from __future__ import annotations

import trio

from gateway.errors import RequestTimeout
from gateway.middleware.asgi import ASGIApp, Message, Receive, Scope, Send

DRAIN_BYTES = 64 * 1024 * 1024  # bytes of an unread body read and dropped before its response ends
DRAIN_SECONDS = 10.0  # the longest a response waits on that drain


def announced_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` (bytes), 0 without a body, None for a chunked one or a bad value."""
    length: int | None = 0
    for name, value in scope.get("headers") or []:
        name = name.lower()
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            text = value.strip()
            length = int(text) if text.isdigit() else None
    return length


class _Body:
    """One request's body as the app reads it: bytes seen, whether it ended, the deadline."""

    def __init__(self, receive: Receive, timeout: float, announced: int | None) -> None:
        self._receive = receive
        self.timeout = timeout
        self.deadline = trio.current_time() + timeout if timeout > 0 else float("inf")  # trio clock
        self.announced = announced
        self.read = 0
        self.ended = False  # the last body message (or a disconnect) was received
        self.timed_out = False

    async def receive(self) -> Message:
        """The next message; raises ``RequestTimeout`` when it is still awaited at the deadline.

        A message that arrived in time is returned even when it is read later (a handler that reads its body
        late on a busy server): only waiting past the deadline is a timeout, so the watch is a task that
        cancels the wait, not a deadline on the read itself (trio would cancel that before it looked)."""
        if self.ended or self.timed_out or self.deadline == float("inf"):
            return await self.receive_unbounded()
        msg: Message | None = None
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await trio.sleep_until(self.deadline)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            msg = await self.receive_unbounded()
            nursery.cancel_scope.cancel()
        if msg is not None:  # else the watch cancelled the wait
            return msg
        self.timed_out = True
        raise RequestTimeout(
            f"The request body did not arrive within {self.timeout:g} seconds.",
            code="request_timeout",
            headers={"connection": "close"},
        )

    async def receive_unbounded(self) -> Message:
        """The next message, counted, with no deadline."""
        msg = await self._receive()
        if msg["type"] == "http.request":
            self.read += len(msg.get("body", b""))
            self.ended = not msg.get("more_body", False)
        else:  # http.disconnect
            self.ended = True
        return msg

    async def discard(self) -> None:
        """Read and drop messages until the body ends or the client leaves."""
        while not self.ended:
            await self.receive_unbounded()

    def drainable(self, budget: int) -> bool:
        """Whether what is left fits ``budget`` bytes (unknown for a chunked body: tried)."""
        if self.ended or self.timed_out:
            return False
        return self.announced is None or self.announced - self.read <= budget


class BodyGuard:
    """Pure ASGI middleware (see the module docstring).

    Args:
        app: the wrapped app.
        timeout: seconds a request body may take to arrive, from the request's headers (0: no bound).
        stopping: set when the server begins to stop; a drain in progress ends then.
        drain_bytes, drain_seconds: the drain's bounds (bytes, seconds).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        timeout: float,
        stopping: trio.Event,
        drain_bytes: int = DRAIN_BYTES,
        drain_seconds: float = DRAIN_SECONDS,
    ) -> None:
        self.app = app
        self.timeout = timeout
        self.stopping = stopping
        self.drain_bytes = drain_bytes
        self.drain_seconds = drain_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        announced = announced_length(scope) if scope["type"] == "http" else 0
        if announced == 0:
            await self.app(scope, receive, send)
            return
        body = _Body(receive, self.timeout, announced)

        async def guarded_send(message: Message) -> None:
            if message["type"] != "http.response.body" or message.get("more_body", False) or body.ended:
                await send(message)
                return
            # the response ends while the body is unread
            if body.drainable(self.drain_bytes) and not self.stopping.is_set():
                if message.get("body"):
                    await send({**message, "more_body": True})
                await self._drain(body)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            if body.ended:
                await send(message)
                return
            # hypercorn hands the app an ``http.disconnect`` when the response ends: with its queue of body
            # messages full, that blocks this send for good unless the queue is read meanwhile
            async with trio.open_nursery() as nursery:
                nursery.start_soon(body.discard)
                await send(message)
                nursery.cancel_scope.cancel()

        await self.app(scope, body.receive, guarded_send)

    async def _drain(self, body: _Body) -> None:
        """Read and drop the rest of ``body`` within the drain's bounds, the body deadline and ``stopping``."""
        start = body.read
        deadline = min(trio.current_time() + self.drain_seconds, body.deadline)
        async with trio.open_nursery() as nursery:

            async def stop_on_shutdown() -> None:
                await self.stopping.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_shutdown)
            with trio.move_on_at(deadline):
                while not body.ended and body.read - start <= self.drain_bytes:
                    await body.receive_unbounded()
            nursery.cancel_scope.cancel()
