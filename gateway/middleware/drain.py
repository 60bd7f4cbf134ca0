"""``DrainGate``: the ASGI middleware that drains the gateway on SIGINT/SIGTERM.

It counts HTTP requests in flight. Once the pool is draining it answers every new request, except the
probes and monitoring paths, with 503 ``server_shutting_down`` in OpenAI's error shape, ``Retry-After`` and
``Connection: close``, without reading the body (a load balancer or client retries elsewhere or later).
``/health`` and ``/healthz`` still answer 200, ``/readyz`` 503, and ``/metrics`` and ``/admin/v1/stats``
(which shows ``draining``) keep working. ``idle()`` returns once nothing admitted is in flight; the server
awaits it when it begins to stop, so it first sets ``stopping``: the body guard
(``gateway.middleware.body``) then stops draining refused bodies, and a request held by one ends at once.

When the drain timeout passes with requests still in flight, the server calls ``cut()``: it sets the
``cutting`` event every request's scope carries (``scope[CUT_KEY]``); each running generation response
(``gateway.streaming.CallResponse``) then stops and ends its answer as its API ends one on an error: a
stream with an error event (503 ``server_shutting_down``) and ``data: [DONE]`` (an NDJSON error line for
Ollama), a response not begun yet with that error. Nothing is left cut off mid-stream.
"""

from __future__ import annotations

from typing import Protocol

import trio

from gateway.errors import ServiceUnavailable
from gateway.middleware.asgi import ASGIApp, Receive, Scope, Send, send_error


class Drainable(Protocol):
    """What the gate reads: ``draining`` (``ModelCatalog.draining``: every model's pool, set by the signal
    handler)."""

    draining: bool


#: The scope key holding the drain gate's ``cutting`` event (set when the drain timeout cuts what runs).
CUT_KEY = "gateway.drain_cut"


def shutting_down() -> ServiceUnavailable:
    """The 503 ``server_shutting_down`` of a request the drain refuses or cuts."""
    return ServiceUnavailable(
        "The server is shutting down; retry the request.",
        code="server_shutting_down",
        headers={"retry-after": str(DrainGate.RETRY_AFTER_S), "connection": "close"},
    )


class DrainGate:
    """Pure ASGI middleware (see module docstring). ``app``: the wrapped app; ``pool``: its drain flag;
    ``stopping``: the event set when the server begins to stop (a new one without it)."""

    RETRY_AFTER_S = 5
    PROBES = ("/health", "/healthz", "/readyz", "/metrics", "/admin/v1/stats")

    def __init__(self, app: ASGIApp, pool: Drainable, *, stopping: trio.Event | None = None) -> None:
        self.app = app
        self.pool = pool
        self.stopping = stopping if stopping is not None else trio.Event()
        self.in_flight = 0
        self.cutting = trio.Event()
        self._idle = trio.Event()
        self._idle.set()

    def cut(self) -> None:
        """The drain timeout passed: every request still running ends its answer now (module docstring)."""
        self.cutting.set()

    async def idle(self) -> None:
        """Set ``stopping``, then return once no admitted request is in flight (at once when none is)."""
        self.stopping.set()
        while self.in_flight:
            await self._idle.wait()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.pool.draining and scope.get("path") not in self.PROBES:
            await self._refuse(send, scope.get("path", ""))
            return
        scope[CUT_KEY] = self.cutting
        self.in_flight += 1
        if self.in_flight == 1:
            self._idle = trio.Event()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _refuse(self, send: Send, path: str) -> None:
        await send_error(send, shutting_down(), path)
