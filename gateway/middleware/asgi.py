"""ASGI 3 callable types (https://asgi.readthedocs.io/en/latest/specs/main.html), for pure ASGI middleware."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]  # ASGI connection scope ("type", "path", "headers"...): values of many types
Message = dict[str, Any]  # one ASGI event ("type", "status", "body"...)
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
