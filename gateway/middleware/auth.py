"""Auth middleware (pure ASGI, inside Starlette): every non-public HTTP request is authenticated once, here.

* A credential-like query parameter (``api_key``, ``token``, ... or a value starting with ``sk-``) is redacted
  from ``scope["query_string"]`` *in place* (hypercorn's access log reads that dict) and the request gets 401,
  on every path.
* :func:`classify_path`: ``public`` paths (exactly :data:`PUBLIC_PATHS`, files under ``/static/``, any
  ``OPTIONS``) pass; ``/admin/...`` (raw or after resolving ``..``/``//``, any case) needs the admin key
  (``scope["state"]["admin"] = True``); everything else, unknown paths included (no 404 before auth), needs a
  tenant key, and its :class:`~auth.principal.Principal` goes to ``scope["state"]["principal"]``
  (``request.state.principal`` in Starlette; handlers read it through ``Gateway.authenticate``).
* Refusals are answered here with OpenAI's error body (401, 403). Every response to a tenant request that
  lacks ``x-ratelimit-*`` headers gets the tenant's current ones (so ``/v1/models`` and 4xx answers carry them).
"""

from __future__ import annotations

from auth.credentials import QUERY_KEY_MESSAGE, query_has_key, redact_query
from gateway.errors import APIError, AuthenticationError
from gateway.middleware.asgi import ASGIApp, Message, Receive, Scope, Send, send_error
from gateway.observability.record import get_record
from gateway.tenants import Tenants

# Exactly what the gateway serves without a key (the playground is GET / and /static/*, the dashboard page GET
# /admin (its data, /admin/v1/*, needs the admin key); /metrics:
# docs/observability.md; /health: liveness as vLLM's; /api/version: no auth, as in Ollama). Matched exactly:
# any other path, aliases and ``..`` forms included, needs a key first, so an unauthenticated client learns
# nothing, not even a 404.
PUBLIC_PATHS = frozenset({"/", "/health", "/healthz", "/readyz", "/metrics", "/openapi.json", "/api/version"})
PUBLIC_PREFIXES = ("/static/",)
ADMIN_PAGE = "/admin"  # the dashboard page itself (this exact path): public, unlike /admin/...
RATE_LIMIT_HEADERS = (b"x-ratelimit-limit-requests", b"x-ratelimit-limit-tokens")


def normalize_path(path: str) -> str:
    """Resolve ``.``, ``..`` and empty segments (``//``): ``/v1/../admin//x/`` -> ``/admin/x/``."""
    segs: list[str] = []
    for s in path.replace("\\", "/").split("/"):
        if s in ("", "."):
            continue
        if s == "..":
            if segs:
                segs.pop()
            continue
        segs.append(s)
    out = "/" + "/".join(segs)
    if path.endswith("/") and segs:
        out += "/"
    return out


def classify_path(
    path: str,
    method: str = "GET",
    *,
    public_paths: frozenset[str] = PUBLIC_PATHS,
    public_prefixes: tuple[str, ...] = PUBLIC_PREFIXES,
) -> str:
    """``"public"``, ``"admin"`` or ``"tenant"`` for a request path; the strictest of the raw and the
    normalized path wins (public only if both are; admin if either is under ``/admin``). Public: an exact
    member of ``public_paths`` (``/health/`` or ``/health/../admin`` is not) or a ``..``/``//``-free path under
    ``public_prefixes``. ``OPTIONS`` (CORS preflight) and exactly :data:`ADMIN_PAGE` (the
    dashboard page) are public; unknown paths are ``tenant``."""
    if method.upper() == "OPTIONS" or path == ADMIN_PAGE:  # the page route only has GET: other methods 405
        return "public"
    norm = normalize_path(path)
    for p in (path.lower(), norm.lower()):
        if p == "/admin" or p.startswith("/admin/"):
            return "admin"

    def public(p: str) -> bool:
        return p in public_paths or (p.startswith(public_prefixes) and ".." not in p and "//" not in p)

    return "public" if public(path) and public(norm) else "tenant"


class AuthMiddleware:
    """See the module docstring. ``public_paths``/``public_prefixes`` as :func:`classify_path`'s;
    ``rate_limit_headers=False`` leaves responses as the app sends them."""

    def __init__(
        self,
        app: ASGIApp,
        tenants: Tenants,
        *,
        public_paths: frozenset[str] = PUBLIC_PATHS,
        public_prefixes: tuple[str, ...] = PUBLIC_PREFIXES,
        rate_limit_headers: bool = True,
    ) -> None:
        self.app = app
        self.tenants = tenants
        self.public_paths = frozenset(public_paths)
        self.public_prefixes = tuple(public_prefixes)
        self.rate_limit_headers = rate_limit_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query: bytes = scope.get("query_string") or b""
        query_key = query_has_key(query)
        if query_key:
            scope["query_string"] = redact_query(query)
        kind = classify_path(
            scope.get("path", "/"),
            scope.get("method", "GET"),
            public_paths=self.public_paths,
            public_prefixes=self.public_prefixes,
        )
        headers = scope.get("headers") or []
        state = scope.setdefault("state", {})
        try:
            if query_key:  # on any path: a credential in a URL ends up in logs, histories, referers
                raise AuthenticationError(QUERY_KEY_MESSAGE)
            if kind == "admin":
                await self.tenants.check_admin(headers)
                state["admin"] = True
            elif kind == "tenant":
                state["principal"] = await self.tenants.authenticate(headers)
        except APIError as e:
            get_record(scope).set_error(e.type, e.code)
            await send_error(send, e, scope.get("path", ""))
            return
        if kind != "tenant" or not self.rate_limit_headers:
            await self.app(scope, receive, send)
            return
        principal = state["principal"]

        async def send_with_headers(message: Message) -> None:
            # every tenant response carries x-ratelimit-*: the admission's (set by the handler) or the current
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers") or []}
                if not names.intersection(RATE_LIMIT_HEADERS):
                    try:
                        extra = await self.tenants.peek_headers(principal)
                    except Exception:  # noqa: BLE001 - headers are best effort
                        extra = {}
                    if extra:
                        message = {
                            **message,
                            "headers": [
                                *(message.get("headers") or []),
                                *((k.encode(), v.encode()) for k, v in extra.items()),
                            ],
                        }
            await send(message)

        await self.app(scope, receive, send_with_headers)
