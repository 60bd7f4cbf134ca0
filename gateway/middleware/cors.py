"""CORS as a pure ASGI middleware that wraps the whole app (outside auth), per the Fetch standard.

Source: WHATWG Fetch, "CORS protocol" (https://fetch.spec.whatwg.org/#http-cors-protocol).

- A CORS preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  here with **204** and the ``Access-Control-Allow-*`` headers, **without calling the app**, so no
  auth runs on it (a preflight never carries credentials; answering it with 401 breaks every
  browser client). Any other ``OPTIONS`` is answered here too: 204 with ``Allow`` (RFC 9110 section
  9.3.7). With ``methods_for`` (the gateway's route table) both list only the methods of the route on
  that path, plus ``OPTIONS``, and a plain ``OPTIONS`` on a path no route has is 404 ``unknown_route``;
  without it, every method the gateway serves.
- Every other response - 200s, SSE streams, **401/403/429/500 errors included** - gets
  ``Access-Control-Allow-Origin`` and ``Access-Control-Expose-Headers`` when the request's origin is
  allowed, so a browser page can read error bodies and the rate-limit headers.
- ``origins="*"`` (default) answers ``Access-Control-Allow-Origin: *``; API keys travel in the
  ``Authorization`` header, not cookies, so no ``Allow-Credentials`` is needed. With a list of
  origins the matching ``Origin`` is echoed and ``Vary: Origin`` is added.

Usage (outermost, so it also wraps auth and error handlers)::

    app = CORSMiddleware(starlette_app, origins=settings.http.cors_origins)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gateway.errors import NotFound
from gateway.middleware.asgi import ASGIApp, Message, Receive, Scope, Send, send_error

#: Response headers a page may read (Fetch "CORS-safelisted response headers" are not enough:
#: the OpenAI rate-limit headers, retry-after(-ms) and the request id must be listed).
EXPOSE_HEADERS = (
    "x-request-id",
    "retry-after",
    "retry-after-ms",
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
    "openai-processing-ms",
    "openai-model",
)
ALLOW_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
#: Request headers allowed when the preflight does not list any (it echoes what it asks for).
DEFAULT_ALLOW_HEADERS = (
    "authorization",
    "content-type",
    "x-request-id",
    "openai-organization",
    "openai-project",
)


def allow_header(methods: Iterable[str]) -> str:
    """The ``Allow`` value for a route serving ``methods``: those and ``OPTIONS``, in a stable order."""
    given = {m.upper() for m in methods} | {"OPTIONS"}
    return ", ".join([m for m in _ORDER if m in given] + sorted(given - set(_ORDER)))


class CORSMiddleware:
    """Pure ASGI CORS middleware (works under hypercorn/trio; no per-request allocation of apps).

    Args:
        app: the ASGI app to wrap.
        origins: ``"*"`` or a list of allowed origins (``scheme://host[:port]``; a trailing slash is dropped);
            an empty list, or one holding ``"*"``, allows any (settings: ``http.cors_origins``).
        max_age: seconds a browser may cache a preflight answer (``Access-Control-Max-Age``).
        expose_headers: response headers scripts may read.
        methods_for: the methods the routes on a path serve (None: no route has it); without it every
            ``OPTIONS`` lists :data:`ALLOW_METHODS`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        origins: str | Iterable[str] = "*",
        max_age: int = 600,
        expose_headers: Iterable[str] = EXPOSE_HEADERS,
        methods_for: Callable[[str], frozenset[str] | None] | None = None,
    ) -> None:
        self.app = app
        self.methods_for = methods_for
        listed = [o.rstrip("/") for o in ([origins] if isinstance(origins, str) else origins)]
        self.any_origin = not listed or "*" in listed
        self.origins = frozenset() if self.any_origin else frozenset(listed)
        self.max_age = max_age
        self.expose = ", ".join(expose_headers)

    def _allow_origin(self, origin: str | None) -> str | None:
        if self.any_origin:
            return "*"
        if origin and origin in self.origins:
            return origin
        return None

    def _cors_headers(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        allow = self._allow_origin(origin)
        h: list[tuple[bytes, bytes]] = []
        if not self.any_origin:
            h.append((b"vary", b"Origin"))
        if allow is None:
            return h
        h.append((b"access-control-allow-origin", allow.encode("latin-1")))
        h.append((b"access-control-expose-headers", self.expose.encode("latin-1")))
        return h

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        origin_b = headers.get(b"origin")
        origin = origin_b.decode("latin-1") if origin_b is not None else None

        if scope["method"] == "OPTIONS":
            await self._options(scope, origin, headers, send)
            return

        extra = self._cors_headers(origin)

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k for k, _ in extra}
                raw = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": raw + extra}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _options(
        self, scope: Scope, origin: str | None, headers: dict[bytes, bytes], send: Send
    ) -> None:
        """A preflight or a plain ``OPTIONS``: 204 with ``Allow`` (404 for a plain one on an unknown path)."""
        path: str = scope.get("path", "/")
        methods = self.methods_for(path) if self.methods_for is not None else None
        preflight = origin is not None and b"access-control-request-method" in headers
        if methods is None and self.methods_for is not None and not preflight:
            out = self._cors_headers(origin)
            err = NotFound(f"Unknown route: OPTIONS {path}", code="unknown_route")

            async def with_cors(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message["headers"], *out]}
                await send(message)

            await send_error(with_cors, err, path)
            return
        allow = allow_header(methods).encode() if methods is not None else ", ".join(ALLOW_METHODS).encode()
        out = self._cors_headers(origin)
        if preflight and self._allow_origin(origin) is not None:
            req_headers = headers.get(b"access-control-request-headers")
            allow_headers = req_headers if req_headers else ", ".join(DEFAULT_ALLOW_HEADERS).encode()
            out += [
                (b"access-control-allow-methods", allow),
                (b"access-control-allow-headers", allow_headers),
                (b"access-control-max-age", str(self.max_age).encode()),
            ]
        out += [(b"allow", allow), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})
