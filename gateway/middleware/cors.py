"""CORS as a pure ASGI middleware that wraps the whole app (outside auth), per the Fetch standard.

Source: WHATWG Fetch, "CORS protocol" (https://fetch.spec.whatwg.org/#http-cors-protocol).

- A CORS preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  here with **204** and the ``Access-Control-Allow-*`` headers, **without calling the app**, so no
  auth runs on it (a preflight never carries credentials; answering it with 401 breaks every
  browser client). Any other ``OPTIONS`` is also answered 204 (with ``Allow``).
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

from collections.abc import Iterable

from gateway.middleware.asgi import ASGIApp, Message, Receive, Scope, Send

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
#: Request headers allowed when the preflight does not list any (it echoes what it asks for).
DEFAULT_ALLOW_HEADERS = (
    "authorization",
    "content-type",
    "x-request-id",
    "openai-organization",
    "openai-project",
)


class CORSMiddleware:
    """Pure ASGI CORS middleware (works under hypercorn/trio; no per-request allocation of apps).

    Args:
        app: the ASGI app to wrap.
        origins: ``"*"`` or a list of allowed origins (``scheme://host[:port]``; a trailing slash is dropped);
            an empty list, or one holding ``"*"``, allows any (settings: ``http.cors_origins``).
        max_age: seconds a browser may cache a preflight answer (``Access-Control-Max-Age``).
        expose_headers: response headers scripts may read.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        origins: str | Iterable[str] = "*",
        max_age: int = 600,
        expose_headers: Iterable[str] = EXPOSE_HEADERS,
    ) -> None:
        self.app = app
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
            await self._preflight(origin, headers, send)
            return

        extra = self._cors_headers(origin)

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k for k, _ in extra}
                raw = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": raw + extra}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, origin: str | None, headers: dict[bytes, bytes], send: Send) -> None:
        out = self._cors_headers(origin)
        if self._allow_origin(origin) is not None:
            req_headers = headers.get(b"access-control-request-headers")
            allow_headers = req_headers if req_headers else ", ".join(DEFAULT_ALLOW_HEADERS).encode()
            out += [
                (b"access-control-allow-methods", ", ".join(ALLOW_METHODS).encode()),
                (b"access-control-allow-headers", allow_headers),
                (b"access-control-max-age", str(self.max_age).encode()),
            ]
        out += [(b"allow", ", ".join(ALLOW_METHODS).encode()), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})
