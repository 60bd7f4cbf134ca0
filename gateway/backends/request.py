"""The consumer side of one backend request (``RequestHandle``) and the errors a backend link raises.

A handle is fed by its ``BackendClient``'s reader task (``deliver``/``fail``/``settle``, synchronous, same
thread) and read by one HTTP handler (``next``/``receive_nowait``); ``close()`` and ``abort_choice()`` call
back into the client through the small ``Aborter`` protocol.

Token accounting (what is billed) happens here, where the outputs arrive, not where they reach the client:
``deliver`` counts every token of every output of the request, also after the consumer left (the client
keeps feeding a closed handle until the backend's last word on it), and each choice's final output carries
the backend's own count (``Usage.completion_tokens``, the EOS token and tokens sampled after an ``Abort``
was sent included). ``generated_tokens`` is exact once ``settled`` is set.

Backlog (tokens that arrived and that the consumer has not taken yet, per choice): while the consumer is
blocked handing output to its HTTP client (``sending``), more than ``max_backlog`` tokens behind on any
choice makes ``deliver`` refuse the output; the client then fails the request with ``SlowConsumer`` and
aborts it in the backend. The channel itself holds at most ``buffer`` outputs (a memory cap per request,
whoever is slow).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import trio

from backend.protocol import RequestError, RequestOutput
from gateway.errors import APIError, ContextLengthExceeded, InternalError, InvalidRequest, ServiceUnavailable

DEFAULT_REQUEST_BUFFER = 4096  # RequestOutput messages buffered per request before it counts as "too slow"
DEFAULT_MAX_BACKLOG = 256  # tokens per choice a client may leave unread before the request is stopped


class Aborter(Protocol):
    """What a handle needs from its client: queue ``Abort`` frames and forget a request (synchronous, never
    raise)."""

    def abort(self, request_id: str) -> None: ...

    def abort_choice(self, request_id: str, index: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


class BackendUnavailable(ServiceUnavailable):
    """503: the backend connection ended (process died, restart, shutdown) while the request was pending."""

    def __init__(self, message: str = "The inference backend is unavailable; retry the request.") -> None:
        super().__init__(message, code="backend_unavailable")


class SlowConsumer(APIError):
    """The request was stopped because its output was not read: more than the backlog limit of tokens of a
    choice (or the channel's capacity of outputs) waited for the consumer. A streaming client that stopped
    reading ends as 499 ``abort`` (reason ``slow_reader``, ``gateway.generation.run``); the 503 is what a
    request whose own handler fell behind is answered."""

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

    Args:
        client: the link (``Aborter``) that feeds this handle.
        request_id: the backend request id; n: choices (>= 1).
        buffer: channel capacity in outputs (>= 1).
        max_backlog: tokens per choice the consumer may fall behind while it is ``sending`` (>= 1).

    Attributes:
        done: the consumer gets nothing more (finished, failed, aborted or closed).
        settled: a ``trio.Event`` set once the backend will report nothing more about this request's
            tokens: every choice's final output arrived, the backend failed the request, or the link ended.
        slow: the request was stopped because its consumer fell behind (``SlowConsumer``).
        sending: set by the consumer while it waits on its own client (``sending_to_client``).
        submitted_at: ``perf_counter`` seconds when Submit was queued; first_rx: when the frame with the first
            output was decoded (None before).
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
        "max_backlog",
        "sending",
        "slow",
        "settled",
        "_arrived",
        "_taken",
        "_counted",
        "_final",
        "_finals",
    )

    def __init__(
        self, client: Aborter, request_id: str, n: int, buffer: int, max_backlog: int = DEFAULT_MAX_BACKLOG
    ) -> None:
        self.request_id = request_id
        self.n = n
        self._client = client
        self._send, self._recv = trio.open_memory_channel[RequestOutput](buffer)
        self._remaining = n
        self.error: APIError | None = None
        self.done = False
        self.submitted_at = time.perf_counter()
        self.first_rx: float | None = None
        self.max_backlog = max_backlog
        self.sending = False
        self.slow = False
        self.settled = trio.Event()
        self._arrived = [0] * n  # tokens that arrived, per choice
        self._taken = [0] * n  # tokens the consumer took, per choice
        self._counted: list[int | None] = [None] * n  # the backend's count, from the choice's final output
        self._final = [False] * n
        self._finals = 0

    # ------------------------------------------------------------------ tokens
    @property
    def generated_tokens(self) -> int:
        """Tokens the backend generated for this request, all choices (exact once ``settled``): per choice
        the backend's own count when its final output arrived, else the tokens that arrived."""
        return sum(max(a, c or 0) for a, c in zip(self._arrived, self._counted, strict=True))

    def _took(self, out: RequestOutput | None) -> RequestOutput | None:
        if out is not None and 0 <= out.index < self.n:
            self._taken[out.index] += len(out.new_token_ids)
        return out

    @contextmanager
    def sending_to_client(self) -> Iterator[None]:
        """``with handle.sending_to_client(): await <write to the HTTP client>``: while inside, a backlog
        over ``max_backlog`` tokens stops the request."""
        self.sending = True
        try:
            yield
        finally:
            self.sending = False

    # ------------------------------------------------------------------ consumer side
    def receive_nowait(self) -> RequestOutput | None:
        """Next buffered output without waiting; raises ``trio.WouldBlock`` if none is buffered yet."""
        try:
            return self._took(self._recv.receive_nowait())
        except trio.EndOfChannel:
            if self.error is not None:
                raise self.error from None
            return None

    async def next(self) -> RequestOutput | None:
        """Next output; None after the last one. Raises the request's ``APIError`` on failure."""
        try:
            return self._took(await self._recv.receive())
        except trio.EndOfChannel:
            if self.error is not None:
                raise self.error from None
            return None

    async def wait_settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``settled`` (call it after ``close()``), then let the client
        forget the request. Returns whether the count is final."""
        with trio.move_on_after(timeout):
            await self.settled.wait()
        self._client.forget(self.request_id)
        return self.settled.is_set()

    # ------------------------------------------------------------------ called by the client's reader task
    def deliver(self, out: RequestOutput) -> bool:
        """Count one output and route it to the consumer; False if the consumer is too slow (the caller fails
        and aborts the request). After ``done`` it is only counted."""
        i = out.index
        fin = out.finish_reason is not None
        if 0 <= i < self.n:
            self._arrived[i] += len(out.new_token_ids)
            if fin and not self._final[i]:
                self._final[i] = True
                self._finals += 1
                if out.usage is not None:
                    self._counted[i] = out.usage.completion_tokens
                if self._finals >= self.n:
                    self.settled.set()
            if self.done:
                return True
            if not fin and self.sending and self._arrived[i] - self._taken[i] > self.max_backlog:
                return False
        elif self.done:
            return True
        try:
            self._send.send_nowait(out)
        except trio.WouldBlock:
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return True  # consumer went away; its close() sends the abort
        if fin:
            self._remaining -= 1
            if self._remaining <= 0:
                self.done = True
                self._send.close()
        return True

    def fail(self, error: APIError) -> None:
        """End the request for the consumer with ``error`` (raised by its next read); no-op once done. The
        outputs already buffered are still read first."""
        if self.done:
            return
        self.done = True
        self.error = error
        self.slow = isinstance(error, SlowConsumer)
        self._send.close()

    def settle(self) -> None:
        """The backend will send nothing more about this request (it failed it, or the link ended)."""
        self.settled.set()

    # ------------------------------------------------------------------ consumer side, synchronous
    def abort_choice(self, index: int) -> None:
        """Ask the backend to stop choice ``index`` only (``Abort(index=...)``) while the others go on; its
        final "abort" output still arrives and is counted. Synchronous, never raises."""
        if not self.done:
            self._client.abort_choice(self.request_id, index)

    def close(self) -> None:
        """Stop consuming. If the backend is still producing, send ``Abort`` (synchronous, never blocks); the
        client keeps counting the request's outputs until ``settled``."""
        if not self.done:
            self.done = True
            self._send.close()
            self._client.abort(self.request_id)
        self._recv.close()

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
