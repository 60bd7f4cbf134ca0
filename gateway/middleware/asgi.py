"""ASGI 3 callable types (https://asgi.readthedocs.io/en/latest/specs/main.html) for pure ASGI middleware, and
``send_error``: an ``APIError`` as a whole JSON response on a raw ``send``."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.errors import APIError

Scope = dict[str, Any]  # ASGI connection scope ("type", "path", "headers"...): values of many types
Message = dict[str, Any]  # one ASGI event ("type", "status", "body"...)
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, e: APIError, path: str = "") -> None:
    """Send an APIError as a complete JSON response on a raw ASGI ``send`` (Ollama's shape under /api/)."""
    body = json.dumps(e.body_for(path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
