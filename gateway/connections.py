"""Connections bounded: closed ones released at once, a cap in total and per client address, the open-file
limit raised, accept errors logged once per interval.

* **EOF.** hypercorn's Trio worker (0.18) ends a connection's read loop when the client closes, but the
  connection's task group still waits for its keep-alive timer, so the socket stays open (CLOSE_WAIT) for
  ``keep_alive_timeout`` seconds after the client left: a client opening and closing connections exhausts
  the file limit. ``GatewayTCPServer._read_data`` stops that timer once the read loop ended, and the
  connection closes at once.
* **Caps.** ``ConnectionCaps`` counts the open connections, in total and per client IP address. One over a
  cap is answered at once, before its request is read, with the API's error shape and ``Connection: close``:
  429 ``too_many_connections`` past ``http.max_connections_per_client`` (one address holding too many), 503
  ``too_many_connections`` past ``http.max_connections`` (the server full; ``Retry-After: 1``); then the
  connection is closed (its unread request drained for at most ``REFUSE_DRAIN_S`` so the client reads the
  answer rather than a reset). Behind a proxy every client has the proxy's address: set the per-client cap
  to 0 (none) there.
* **Open files.** ``raise_nofile`` raises the soft ``RLIMIT_NOFILE`` to the hard limit at start (logged);
  the total cap defaults to that limit less ``RESERVED_FILES`` (backend sockets, the database, logs).
* **EMFILE.** When the process is out of files anyway, trio's ``serve_listeners`` logs ``accept returned
  EMFILE`` with a traceback every 0.1 s it retries. ``OncePerInterval`` (a filter on that logger) lets one
  line through per ``interval`` seconds, without the traceback, saying how many it held back.

hypercorn builds its connection handler from ``hypercorn.trio.run.TCPServer``; ``install`` puts
``GatewayTCPServer`` there (the gateway serves one hypercorn server per process).
"""

from __future__ import annotations

import logging
import math
import resource
import time

import hypercorn.trio.run as hyper_run
import msgspec
import trio
from hypercorn.trio.tcp_server import TCPServer

from gateway.errors import APIError, RateLimited, ServiceUnavailable

log = logging.getLogger("gateway")

RESERVED_FILES = 128  # files kept out of the default total cap: backend links, the database, logs, threads
REFUSE_DRAIN_S = 1.0  # seconds a refused connection's unread request is drained before it is closed
NOFILE_CEILING = 1 << 20  # the soft limit is raised to the hard one, at most this (an unlimited hard limit)


class ConnectionCaps:
    """Open connections, in total and per client address (one actor's state: only the connection tasks of
    one Trio run touch it, with no await between a check and its count).

    Args:
        total: connections open at once (0: no cap).
        per_client: connections one client IP address may hold open (0: no cap).
    """

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self.open = 0
        self.by_client: dict[str, int] = {}
        self.refused = 0

    def acquire(self, client: str) -> APIError | None:
        """Count a new connection from ``client``; the refusal to send instead when it is over a cap (nothing
        counted then)."""
        if self.per_client and self.by_client.get(client, 0) >= self.per_client:
            self.refused += 1
            return RateLimited(
                f"Too many open connections from this address (at most {self.per_client}); reuse one.",
                type="requests",
                code="too_many_connections",
                headers={"retry-after": "1", "connection": "close"},
            )
        if self.total and self.open >= self.total:
            self.refused += 1
            return ServiceUnavailable(
                "The server has too many open connections; retry shortly.",
                code="too_many_connections",
                headers={"retry-after": "1", "connection": "close"},
            )
        self.open += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        return None

    def release(self, client: str) -> None:
        """Uncount a connection ``acquire`` counted."""
        self.open -= 1
        left = self.by_client.get(client, 1) - 1
        if left > 0:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)


def _refusal_bytes(err: APIError) -> bytes:
    body = msgspec.json.encode(err.body())
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}.get(err.status, "Error")
    head = [
        f"HTTP/1.1 {err.status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
    ]
    head += [f"{k}: {v}" for k, v in (err.headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class GatewayTCPServer(TCPServer):
    """hypercorn's Trio connection handler with the caps of ``caps`` and a prompt close on EOF."""

    caps: ConnectionCaps = ConnectionCaps(0, 0)

    async def run(self) -> None:
        try:
            client = str(self.stream.socket.getpeername()[0])
        except (AttributeError, OSError, IndexError, TypeError):  # TLS stream, a socket already gone
            client = ""
        refusal = self.caps.acquire(client)
        if refusal is not None:
            await self._refuse(refusal)
            return
        try:
            await super().run()
        finally:
            self.caps.release(client)

    async def _refuse(self, err: APIError) -> None:
        try:
            with trio.move_on_after(REFUSE_DRAIN_S):
                await self.stream.send_all(_refusal_bytes(err))
                await self.stream.send_eof()
                while await self.stream.receive_some(65536):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, AttributeError):
            pass
        finally:
            await trio.aclose_forcefully(self.stream)

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()  # the client is gone: the keep-alive timer must not hold the socket


def install(caps: ConnectionCaps) -> None:
    """Make hypercorn's Trio worker handle connections with ``GatewayTCPServer`` under ``caps``."""
    GatewayTCPServer.caps = caps
    hyper_run.TCPServer = GatewayTCPServer  # type: ignore[misc]


def raise_nofile() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most ``NOFILE_CEILING``); logged when it
    changes. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NOFILE_CEILING if hard == resource.RLIM_INFINITY else min(hard, NOFILE_CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit (RLIMIT_NOFILE) from %d: %s", soft, exc)
            return soft
        log.info("open-file limit (RLIMIT_NOFILE) raised from %d to %d (the hard limit)", soft, target)
        return target
    return NOFILE_CEILING if soft == resource.RLIM_INFINITY else soft


def default_total(nofile: int) -> int:
    """The total connection cap for an open-file limit of ``nofile``: the limit less ``RESERVED_FILES``."""
    return max(16, nofile - RESERVED_FILES)


class OncePerInterval(logging.Filter):
    """Let one record through per ``interval`` seconds, without its traceback, noting how many were held
    back since the last one (trio's ``accept returned EMFILE ...; retrying``, logged every 0.1 s)."""

    def __init__(self, interval: float = 10.0, clock=time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self.clock = clock
        self.last = -math.inf
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        if now - self.last < self.interval:
            self.held += 1
            return False
        self.last = now
        record.exc_info = None
        record.exc_text = None
        if self.held:
            record.msg = f"{record.msg} ({self.held} more like it in the last {self.interval:g} s not logged)"
        self.held = 0
        return True


def quiet_accept_errors(interval: float = 10.0) -> None:
    """Install ``OncePerInterval`` on trio's ``serve_listeners`` logger (once)."""
    logger = logging.getLogger("trio.serve_listeners")
    if not any(isinstance(f, OncePerInterval) for f in logger.filters):
        logger.addFilter(OncePerInterval(interval))
