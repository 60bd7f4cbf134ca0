"""``HopGuard``: the ASGI middleware that refuses a request which has already passed through this gateway.

Every request this gateway sends to an upstream model (``gateway.upstream.client``) carries a ``Via`` header
(RFC 9110 section 7.6.3): the ``Via`` it received, if any, then ``1.1 <INSTANCE>``, this process's
pseudonym (``llm-gateway-`` + 12 random hex digits, new at each start). A request that arrives with
``INSTANCE`` in its ``Via`` has come back here, through an upstream model that points at this gateway
(directly, through a proxy or load balancer, or through other gateways that pass ``Via`` on): it is refused
at once, before authentication and before its body is read, with 508 ``loop_detected`` in the API's error
shape (Ollama's under ``/api/``, else OpenAI's), so a loop costs two requests, not one per level until the
file limit. The gateway that sent it passes the 508 on to its client (``gateway.upstream.client``).

The ``Via`` a request brought (its value, or None) is kept in a context variable for the request's task
(and the tasks it starts), read by :func:`outgoing_via`: nothing is shared between requests.
"""

from __future__ import annotations

import contextvars
import re
import secrets

from gateway.errors import LoopDetected
from gateway.middleware.asgi import ASGIApp, Receive, Scope, Send, send_error

#: This process's pseudonym in ``Via`` headers.
INSTANCE = "llm-gateway-" + secrets.token_hex(6)
_MAX_VIA = 4096  # characters of a received Via passed on (a longer one is cut to its last entries)
_incoming: contextvars.ContextVar[str | None] = contextvars.ContextVar("incoming_via", default=None)
_ENTRY = re.compile(r"\s*,\s*")


def passed_here(via: str) -> bool:
    """Whether the ``Via`` value ``via`` names this gateway (an entry ``<protocol> INSTANCE [comment]``)."""
    return any(INSTANCE in entry.split()[1:2] for entry in _ENTRY.split(via) if entry)


def outgoing_via() -> str:
    """The ``Via`` of a request this gateway sends upstream for the current request: the one received (its
    last ``_MAX_VIA`` characters, whole entries) then this gateway's entry."""
    received = _incoming.get()
    own = f"1.1 {INSTANCE}"
    if not received:
        return own
    if len(received) > _MAX_VIA:
        received = received[-_MAX_VIA:].partition(",")[2].strip()
    return f"{received}, {own}" if received else own


class HopGuard:
    """Pure ASGI middleware (see the module docstring); ``app``: the wrapped app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        values = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"via"]
        via = ", ".join(values) if values else None
        if via is not None and passed_here(via):
            err = LoopDetected(
                "This request has already passed through this gateway: an upstream model leads back to it "
                "(a loop). Point the model's urls at another server."
            )
            await send_error(send, err, scope.get("path", ""))
            return
        token = _incoming.set(via)
        try:
            await self.app(scope, receive, send)
        finally:
            _incoming.reset(token)
