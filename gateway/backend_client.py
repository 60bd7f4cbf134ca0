"""``BackendClient``: one actor per connection to a backend process.

The client owns the socket and all per-connection state. Two tasks run in the
nursery of ``run()``:

* the *writer* drains the mailbox (an unbounded Trio memory channel of
  ``Submit``/``Abort``/``GetStats``/``Shutdown`` messages) onto the socket,
  coalescing whatever is queued into one ``send_all``;
* the *reader* decodes frames (``backend/protocol.py``) and routes each
  ``RequestOutput`` of a ``StepOutputs`` frame to the request's bounded
  channel with ``send_nowait``. A full channel means the consumer (an HTTP
  client) is too slow: that request is failed and aborted, never waited on,
  so one slow client cannot stall the others.

Request handlers use ``open_request()`` (synchronous; it queues the
``Submit``) and read with ``await handle.next()``. ``handle.close()`` and
``client.abort()`` are plain synchronous methods, safe in ``finally`` blocks
and under cancellation: leaving a handle before its last output sends
``Abort``.

When the connection ends (EOF, protocol error, ``Fatal``), every pending
request fails with ``BackendUnavailable`` (HTTP 503 before streaming, an
error event mid-stream) and the mailbox closes; the supervisor decides what
happens next.

Sources: design-sketch.md ("Gateway actors"); Trio memory channels
(https://trio.readthedocs.io/en/stable/reference-core.html#using-channels-to-pass-values-between-tasks).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Any

import trio

from backend.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Fatal,
    GetStats,
    Hello,
    ProtocolError,
    Ready,
    RequestError,
    RequestOutput,
    Shutdown,
    Stats,
    StepOutputs,
    Submit,
    encode_frame,
    from_backend_decoder,
)
from gateway.errors import APIError, ContextLengthExceeded, InternalError, InvalidRequest, ServiceUnavailable

log = logging.getLogger("gateway.backend")

DEFAULT_REQUEST_BUFFER = 4096  # RequestOutput messages buffered per request before it counts as "too slow"


class BackendUnavailable(ServiceUnavailable):
    """503: the backend connection ended (process died, restart, shutdown) while the request was pending."""

    def __init__(self, message: str = "The inference backend is unavailable; retry the request.") -> None:
        super().__init__(message, code="backend_unavailable")


class SlowConsumer(APIError):
    """The client read its stream too slowly; its per-request buffer overflowed and the request was aborted."""

    status = 503
    type = "server_error"

    def __init__(self) -> None:
        super().__init__(
            "The client did not read the response fast enough; the request was aborted.", code="slow_consumer"
        )


def request_error_to_api(err: RequestError) -> APIError:
    """Map a backend ``RequestError`` (OpenAI-style code) to the gateway's exception tree."""
    if err.code == "context_length_exceeded":
        return ContextLengthExceeded(err.message, param=err.param or "messages")
    if err.code in (
        "invalid_request_error",
        "invalid_parameter",
    ):  # the backend's names for OpenAI's invalid_value
        return InvalidRequest(err.message, param=err.param, code="invalid_value")
    if err.code == "invalid_token_id":
        return InvalidRequest(err.message, param=err.param, code=err.code)
    return InternalError("The inference backend failed on this request.", code=err.code or "internal_error")


def parse_backend_url(url: str) -> tuple[str, str | tuple[str, int]]:
    """``unix:PATH`` -> ("unix", PATH); ``tcp://HOST:PORT`` -> ("tcp", (HOST, PORT)).

    Raises:
        ValueError: any other form.
    """
    if url.startswith("unix:"):
        path = url[5:]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError(f"empty unix socket path in {url!r}")
        return "unix", path
    if url.startswith("tcp://"):
        host, sep, port = url[6:].rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"backend url {url!r} lacks a port")
        return "tcp", (host.strip("[]") or "127.0.0.1", int(port))
    raise ValueError(f"backend url must be unix:PATH or tcp://HOST:PORT, got {url!r}")


async def open_backend_stream(url: str) -> trio.abc.Stream:
    """Connect to ``url`` (see ``parse_backend_url``). Raises OSError when nothing listens."""
    kind, addr = parse_backend_url(url)
    if kind == "unix":
        return await trio.open_unix_socket(addr)  # type: ignore[arg-type]
    host, port = addr  # type: ignore[misc]
    stream = await trio.open_tcp_stream(host, port)
    try:
        import socket

        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass
    return stream


class RequestHandle:
    """The consumer side of one in-flight backend request.

    ``await next()`` returns the next ``RequestOutput`` (one per engine step per
    choice) or None after the last choice finished; it raises the request's
    error (``APIError``) if the backend rejected it, the connection died, or
    the consumer fell behind. ``close()`` is synchronous and idempotent: if
    the request has not finished it is removed and ``Abort`` is queued.
    """

    __slots__ = (
        "request_id",
        "n",
        "_client",
        "_send",
        "_recv",
        "_remaining",
        "error",
        "done",
        "submitted_at",
        "first_rx",
    )

    def __init__(self, client: BackendClient, request_id: str, n: int, buffer: int) -> None:
        self.request_id = request_id
        self.n = n
        self._client = client
        self._send, self._recv = trio.open_memory_channel[RequestOutput](buffer)
        self._remaining = n
        self.error: APIError | None = None
        self.done = False  # the backend will send nothing more (finished, failed or aborted)
        self.submitted_at = time.perf_counter()  # when Submit was queued (seconds, perf_counter)
        self.first_rx: float | None = None  # when the frame with the first output was decoded

    def receive_nowait(self) -> RequestOutput | None:
        """Next buffered output without waiting; raises ``trio.WouldBlock`` if none is buffered yet."""
        try:
            return self._recv.receive_nowait()
        except trio.EndOfChannel:
            if self.error is not None:
                raise self.error from None
            return None

    async def next(self) -> RequestOutput | None:
        """Next output; None after the last one. Raises the request's ``APIError`` on failure."""
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            if self.error is not None:
                raise self.error from None
            return None

    # called by the client's reader task (same thread, no await in between)
    def _deliver(self, out: RequestOutput) -> bool:
        """Route one output; False if the consumer is too slow (caller fails + aborts the request)."""
        try:
            self._send.send_nowait(out)
        except trio.WouldBlock:
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return True  # consumer went away; its close() sends the abort
        if out.finish_reason is not None:
            self._remaining -= 1
            if self._remaining <= 0:
                self.done = True
                self._send.close()
        return True

    def _fail(self, error: APIError) -> None:
        if self.done:
            return
        self.done = True
        self.error = error
        self._send.close()

    def abort_choice(self, index: int) -> None:
        """Ask the backend to stop choice ``index`` only (``Abort(index=...)``) while the others go on; its
        final "abort" output still arrives and is counted. Synchronous, never raises."""
        if not self.done:
            self._client.abort_choice(self.request_id, index)

    def close(self) -> None:
        """Stop consuming. If the backend is still producing, send ``Abort`` (synchronous, never blocks)."""
        if not self.done:
            self.done = True
            self._send.close()
            self._client.abort(self.request_id)
        self._recv.close()

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BackendClient:
    """Actor for one backend connection (see module docstring).

    Args:
        stream: a connected Trio stream on which the ``Hello``/``Ready`` handshake already happened.
        ready: the backend's ``Ready`` message (model card, KV capacity).
        url: where it was reached (for logs and stats).
        request_buffer: per-request channel capacity in ``RequestOutput`` messages.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        ready: Ready,
        *,
        url: str = "",
        request_buffer: int = DEFAULT_REQUEST_BUFFER,
        decoder=None,
    ) -> None:
        self.stream = stream
        self.ready = ready
        self.card = ready.model_card
        self.url = url
        self.request_buffer = request_buffer
        self._decoder = decoder or from_backend_decoder()
        self._mail_send, self._mail_recv = trio.open_memory_channel[Any](math.inf)
        self._pending: dict[str, RequestHandle] = {}
        self._stats_waiters: dict[int, list] = {}
        self._nonce = itertools.count(1)
        self.alive = True
        self.closed_reason: str | None = None
        self.aborts_sent = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    async def connect(
        cls, url: str, *, timeout: float = 30.0, request_buffer: int = DEFAULT_REQUEST_BUFFER
    ) -> BackendClient:
        """Connect to ``url``, send ``Hello``, wait for ``Ready``.

        Raises:
            OSError: nothing listens at ``url``.
            ProtocolError: the backend answered ``Fatal``, another protocol version, or garbage.
            trio.TooSlowError: no ``Ready`` within ``timeout`` seconds.
        """
        stream = await open_backend_stream(url)
        decoder = from_backend_decoder()
        try:
            with trio.fail_after(timeout):
                await stream.send_all(encode_frame(Hello()))
                buffered: list = []
                while not buffered:
                    data = await stream.receive_some(65536)
                    if not data:
                        raise ProtocolError("backend closed the connection during the handshake")
                    buffered = decoder.feed(data)
            first = buffered[0]
            if isinstance(first, Fatal):
                raise ProtocolError(f"backend refused the handshake: {first.message}")
            if not isinstance(first, Ready):
                raise ProtocolError(f"expected Ready, got {type(first).__name__}")
            if first.version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"backend protocol version {first.version}, gateway speaks {PROTOCOL_VERSION}"
                )
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        client = cls(stream, first, url=url, request_buffer=request_buffer, decoder=decoder)
        for extra in buffered[1:]:
            client._dispatch(extra)
        return client

    # ------------------------------------------------------------------ public API (synchronous)
    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (the load used to pick a backend)."""
        return len(self._pending)

    def open_request(self, submit: Submit) -> RequestHandle:
        """Register a request and queue its ``Submit``. Never blocks.

        Raises:
            BackendUnavailable: the connection is closed.
        """
        if not self.alive:
            raise BackendUnavailable()
        handle = RequestHandle(self, submit.request_id, max(1, submit.sampling.n), self.request_buffer)
        self._pending[submit.request_id] = handle
        try:
            self._mail_send.send_nowait(submit)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            del self._pending[submit.request_id]
            raise BackendUnavailable() from None
        return handle

    def abort(self, request_id: str) -> None:
        """Queue ``Abort(request_id)`` and forget the request. Synchronous, idempotent, never raises."""
        h = self._pending.pop(request_id, None)
        if h is not None:
            h._fail(BackendUnavailable("request aborted"))
        if not self.alive:
            return
        try:
            self._mail_send.send_nowait(Abort(request_id=request_id))
            self.aborts_sent += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def abort_choice(self, request_id: str, index: int) -> None:
        """Queue ``Abort(request_id, index)``: stop one choice of an n > 1 request. Never raises."""
        if not self.alive or request_id not in self._pending:
            return
        try:
            self._mail_send.send_nowait(Abort(request_id=request_id, index=index))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def shutdown(self) -> None:
        """Queue ``Shutdown`` (the backend aborts everything and exits). Never raises."""
        try:
            self._mail_send.send_nowait(Shutdown())
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def get_stats(self, timeout: float = 5.0) -> Stats:
        """Ask the backend for its counters.

        Raises:
            BackendUnavailable: connection closed or no answer within ``timeout`` seconds.
        """
        if not self.alive:
            raise BackendUnavailable()
        nonce = next(self._nonce)
        slot: list = [trio.Event(), None]
        self._stats_waiters[nonce] = slot
        try:
            self._mail_send.send_nowait(GetStats(nonce=nonce))
            with trio.move_on_after(timeout):
                await slot[0].wait()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        finally:
            self._stats_waiters.pop(nonce, None)
        if slot[1] is None:
            raise BackendUnavailable("the backend did not answer a stats request")
        return slot[1]

    # ------------------------------------------------------------------ actor body
    async def run(self) -> None:
        """Run reader + writer until the connection ends; then fail everything pending. Never raises
        for connection-level problems (they end ``run`` normally, with ``closed_reason`` set)."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, nursery.cancel_scope)
                try:
                    await self._reader()
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
                    self.closed_reason = f"{type(exc).__name__}: {exc}"
                nursery.cancel_scope.cancel()
        finally:
            self._close_all()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    def _close_all(self) -> None:
        self.alive = False
        self._mail_send.close()
        pending, self._pending = self._pending, {}
        err = BackendUnavailable("The inference backend stopped while this request was running.")
        for h in pending.values():
            h._fail(err)
        for slot in self._stats_waiters.values():
            slot[0].set()

    async def _writer(self, scope: trio.CancelScope) -> None:
        recv = self._mail_recv
        try:
            async for msg in recv:
                buf = bytearray(encode_frame(msg))
                while True:  # coalesce what is already queued into one write
                    try:
                        buf += encode_frame(recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await self.stream.send_all(buf)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.closed_reason = f"write failed: {exc}"
            scope.cancel()

    async def _reader(self) -> None:
        while True:
            data = await self.stream.receive_some(1 << 20)
            if not data:
                self.closed_reason = self.closed_reason or "backend closed the connection"
                return
            try:
                msgs = self._decoder.feed(data)
            except ProtocolError as exc:
                for m in getattr(exc, "decoded", []):
                    self._dispatch(m)
                raise
            for m in msgs:
                self._dispatch(m)
            if not self.alive:
                return

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            pending = self._pending
            now = time.perf_counter()
            for out in msg.outputs:
                h = pending.get(out.request_id)
                if h is None:
                    continue
                if h.first_rx is None:
                    h.first_rx = now
                if not h._deliver(out):
                    del pending[out.request_id]
                    h._fail(SlowConsumer())
                    self.abort(out.request_id)
                elif h.done:
                    del pending[out.request_id]
        elif isinstance(msg, RequestError):
            h = self._pending.pop(msg.request_id, None)
            if h is not None:
                h._fail(request_error_to_api(msg))
        elif isinstance(msg, Stats):
            slot = self._stats_waiters.get(msg.nonce)
            if slot is not None:
                slot[1] = msg
                slot[0].set()
            else:  # a backend that ignores nonces: satisfy the oldest waiter
                for slot in self._stats_waiters.values():
                    if slot[1] is None:
                        slot[1] = msg
                        slot[0].set()
                        break
        elif isinstance(msg, Fatal):
            self.closed_reason = f"backend fatal: {msg.message}"
            log.error("backend %s: fatal: %s", self.url, msg.message)
            self.alive = False
        elif isinstance(msg, Ready):
            pass
