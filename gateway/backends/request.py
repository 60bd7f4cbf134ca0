"""The consumer side of one backend request (``RequestHandle``) and the errors a backend link raises.

A handle is fed by its ``BackendClient``'s reader task (``deliver``/``fail``, synchronous, same thread) and
read by one HTTP handler (``next``/``receive_nowait``); ``close()`` and ``abort_choice()`` call back into the
client through the small ``Aborter`` protocol.
"""

from __future__ import annotations

import time
from typing import Protocol

import trio

from backend.protocol import RequestError, RequestOutput
from gateway.errors import APIError, ContextLengthExceeded, InternalError, InvalidRequest, ServiceUnavailable

DEFAULT_REQUEST_BUFFER = 4096  # RequestOutput messages buffered per request before it counts as "too slow"


class Aborter(Protocol):
    """What a handle needs from its client: queue ``Abort`` frames (synchronous, never raise)."""

    def abort(self, request_id: str) -> None: ...

    def abort_choice(self, request_id: str, index: int) -> None: ...


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
    if err.code == "grammar_error":  # the grammar failed to compile there, or the output left it
        return InvalidRequest(err.message, param=None, code="grammar_error")
    if err.code == "unsupported_feature":
        return InvalidRequest(err.message, param=None, code="unsupported_parameter")
    return InternalError("The inference backend failed on this request.", code=err.code or "internal_error")


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

    def __init__(self, client: Aborter, request_id: str, n: int, buffer: int) -> None:
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
    def deliver(self, out: RequestOutput) -> bool:
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

    def fail(self, error: APIError) -> None:
        """End the request with ``error`` (raised by the consumer's next read); no-op once done."""
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
