"""``BackendClient``: one actor per connection to a backend process.

The client owns the socket and all per-connection state. Two tasks run in the
nursery of ``run()``:

* the *writer* drains the mailbox (an unbounded Trio memory channel of
  ``Submit``/``Abort``/``GetStats``/``Shutdown`` messages) onto the socket,
  coalescing whatever is queued into one ``send_all``;
* the *reader* decodes frames (``backend/protocol.py``) and routes each
  ``RequestOutput`` of a ``StepOutputs`` frame to the request's bounded
  channel with ``send_nowait``. A consumer too far behind (more than its
  token backlog while it waits on its HTTP client, or a full channel) is
  failed with ``SlowConsumer`` and its request aborted, never waited on,
  so one slow client cannot stall the others.

Every output of a request is counted by its handle, also after the consumer
left: an aborted request stays in ``_draining`` until the backend's final
output of each of its choices arrived (their ``Usage`` is the backend's own
count), the backend failed it, the link ended, or its owner gave up waiting
(``forget``). That count is what is billed (``RequestHandle.generated_tokens``).

Request handlers use ``open_request()`` (synchronous; it queues the
``Submit``) and read with ``await handle.next()``. ``handle.close()`` and
``client.abort()`` are plain synchronous methods, safe in ``finally`` blocks
and under cancellation: leaving a handle before its last output sends
``Abort``.

``connect`` runs the handshake of ``backend/protocol.py`` (Hello with a fresh nonce; with a secret, the
``Proof`` answer to the backend's ``Challenge`` and a check of ``Ready.proof`` with ``hmac.compare_digest``).
Any failure there closes the stream and raises ``ProtocolError``; a refused or missing proof raises
``AuthenticationFailed``, which the supervisor does not retry at first start.

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

import trio

from backend.protocol import (
    FEATURE_GRAMMAR,
    PROTOCOL_VERSION,
    Abort,
    AuthenticationFailed,
    Challenge,
    Fatal,
    FrameDecoder,
    FromBackend,
    GetStats,
    Hello,
    Proof,
    ProtocolError,
    Ready,
    RequestError,
    Shutdown,
    Stats,
    StepOutputs,
    Submit,
    ToBackend,
    encode_frame,
    from_backend_decoder,
    new_nonce,
    proof_matches,
    proof_of,
)
from gateway.backends.address import LinkCredentials, is_network_url, open_backend_stream
from gateway.backends.request import (
    DEFAULT_MAX_BACKLOG,
    DEFAULT_REQUEST_BUFFER,
    BackendUnavailable,
    RequestHandle,
    SlowConsumer,
    request_error_to_api,
)

log = logging.getLogger("gateway.backend")


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
        decoder: FrameDecoder | None = None,
    ) -> None:
        self.stream = stream
        self.ready = ready
        self.card = ready.model_card
        self.url = url
        self.request_buffer = request_buffer
        self._decoder = decoder or from_backend_decoder()
        self._mail_send, self._mail_recv = trio.open_memory_channel[ToBackend](math.inf)
        self._pending: dict[str, RequestHandle] = {}  # consumed requests
        self._draining: dict[str, RequestHandle] = {}  # aborted, counted until their last output
        self._stats_waiters: dict[int, list] = {}
        self._nonce = itertools.count(1)
        self.alive = True
        self.closed_reason: str | None = None
        self.aborts_sent = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        timeout: float = 30.0,
        request_buffer: int = DEFAULT_REQUEST_BUFFER,
        credentials: LinkCredentials | None = None,
    ) -> BackendClient:
        """Connect to ``url`` and run the handshake (module docstring) within ``timeout`` seconds.

        ``credentials.secret`` answers the backend's ``Challenge``; on a TCP or TLS link a secret is
        required and the backend must prove it too (a unix-socket backend may skip the proof).

        Raises:
            OSError: nothing listens at ``url``.
            AuthenticationFailed: the backend refused our proof, gave none or a wrong one, or asked for a
                secret we do not have (or we have none for a TCP link).
            ProtocolError: the backend answered ``Fatal``, another protocol version, garbage, or hung up.
            trio.TooSlowError: no ``Ready`` within ``timeout`` seconds.
        """
        credentials = credentials or LinkCredentials()
        secret = credentials.secret
        network = is_network_url(url)
        if network and secret is None:
            raise AuthenticationFailed(
                f"backend {url} is a network link: the gateway needs its shared secret "
                "(backend_secret_file or LLM_BACKEND_SECRET)"
            )
        decoder = from_backend_decoder()
        buffered: list = []
        hint = " (a backend listening with TLS has a tls:// URL)" if url.startswith("tcp://") else ""

        async def receive() -> FromBackend:
            while not buffered:
                data = await stream.receive_some(65536)
                if not data:
                    raise ProtocolError(f"backend {url} closed the connection during the handshake{hint}")
                buffered.extend(decoder.feed(data))
            return buffered.pop(0)

        with trio.fail_after(timeout):
            stream = await open_backend_stream(url, credentials.tls)
        try:
            with trio.fail_after(timeout):
                nonce = new_nonce()
                await stream.send_all(encode_frame(Hello(features=[FEATURE_GRAMMAR], nonce=nonce)))
                first = await receive()
                challenged = isinstance(first, Challenge)
                if challenged:
                    if secret is None:
                        raise AuthenticationFailed(
                            f"backend {url} asks for a shared secret (backend_secret_file or LLM_BACKEND_SECRET)"
                        )
                    await stream.send_all(
                        encode_frame(Proof(proof=proof_of("gateway", secret, nonce, first.nonce)))
                    )
                    reply = await receive()
                else:
                    reply = first
            if isinstance(reply, Fatal):
                error = AuthenticationFailed if challenged else ProtocolError
                raise error(f"backend {url} refused the handshake: {reply.message}")
            if not isinstance(reply, Ready):
                raise ProtocolError(f"expected Ready, got {type(reply).__name__}")
            if reply.version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"backend protocol version {reply.version}, gateway speaks {PROTOCOL_VERSION}"
                )
            if challenged and not proof_matches(reply.proof, "backend", secret, nonce, first.nonce):
                raise AuthenticationFailed(f"backend {url} gave a wrong proof of the shared secret")
            if network and not challenged:
                raise AuthenticationFailed(f"backend {url} did not prove the shared secret (it has none)")
        except trio.BrokenResourceError as exc:  # e.g. a TLS listener dropping a plain Hello
            await trio.aclose_forcefully(stream)
            why = exc.__cause__ or exc
            raise ProtocolError(f"backend {url} broke off the handshake: {why}{hint}") from None
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        client = cls(stream, reply, url=url, request_buffer=request_buffer, decoder=decoder)
        for extra in buffered:
            client._dispatch(extra)
        return client

    # ------------------------------------------------------------------ public API (synchronous)
    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (the load used to pick a backend)."""
        return len(self._pending)

    def open_request(self, submit: Submit, *, max_backlog: int = DEFAULT_MAX_BACKLOG) -> RequestHandle:
        """Register a request and queue its ``Submit``. Never blocks. ``max_backlog``: tokens per choice its
        consumer may leave unread while it waits on its client (``RequestHandle``).

        Raises:
            BackendUnavailable: the connection is closed.
        """
        if not self.alive:
            raise BackendUnavailable()
        handle = RequestHandle(
            self, submit.request_id, max(1, submit.sampling.n), self.request_buffer, max_backlog
        )
        self._pending[submit.request_id] = handle
        try:
            self._mail_send.send_nowait(submit)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            del self._pending[submit.request_id]
            raise BackendUnavailable() from None
        return handle

    def abort(self, request_id: str) -> None:
        """Queue ``Abort(request_id)``; the request's outputs are only counted from now on, until it is
        settled. Synchronous, idempotent, never raises."""
        h = self._pending.pop(request_id, None)
        if h is not None:
            h.fail(BackendUnavailable("request aborted"))
            if not h.settled.is_set():
                self._draining[request_id] = h
        if not self.alive:
            return
        try:
            self._mail_send.send_nowait(Abort(request_id=request_id))
            self.aborts_sent += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def forget(self, request_id: str) -> None:
        """Stop counting an aborted request's outputs (its owner stopped waiting). Never raises."""
        self._draining.pop(request_id, None)

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
            self.close_all()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    def close_all(self) -> None:
        """Mark the link dead and fail every pending request and stats waiter (synchronous, idempotent)."""
        self.alive = False
        self._mail_send.close()
        pending, self._pending = self._pending, {}
        draining, self._draining = self._draining, {}
        err = BackendUnavailable("The inference backend stopped while this request was running.")
        for h in pending.values():
            h.fail(err)
            h.settle()
        for h in draining.values():
            h.settle()
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

    def _dispatch(self, msg: FromBackend) -> None:
        if isinstance(msg, StepOutputs):
            pending = self._pending
            now = time.perf_counter()
            for out in msg.outputs:
                h = pending.get(out.request_id)
                if h is None:
                    d = self._draining.get(out.request_id)
                    if d is not None:  # aborted: counted only
                        d.deliver(out)
                        if d.settled.is_set():
                            del self._draining[out.request_id]
                    continue
                if h.first_rx is None:
                    h.first_rx = now
                if not h.deliver(out):
                    h.fail(SlowConsumer())
                    self.abort(out.request_id)
                elif h.done:
                    del pending[out.request_id]
        elif isinstance(msg, RequestError):
            h = self._pending.pop(msg.request_id, None) or self._draining.pop(msg.request_id, None)
            if h is not None:
                h.fail(request_error_to_api(msg))
                h.settle()
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
        elif isinstance(msg, (Ready, Challenge)):
            pass
