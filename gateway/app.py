"""The gateway's ASGI app: every route and the middleware order (``build_app``), and error rendering.

Routes (all declared in ``build_app``):
    POST /v1/chat/completions, POST /v1/completions   OpenAI (gateway/openai/; stream or not, docs/gateway.md)
    GET  /v1/models, /v1/models/{model_id}            every model and alias of the catalog the caller may use
                                                      (gateway/openai/models.py, gateway/catalog.py)
    GET  /v1/inspect/{request_id}                     a request's inspection record (gateway/inspector/)
    GET  /health, /healthz, /readyz                   probes (gateway/probes.py; public)
    GET  /admin/v1/stats                              engine counters (admin key; gateway/probes.py)
    /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version   Ollama (gateway/ollama/)
    GET  /metrics                                     Prometheus (gateway/observability/metrics.py; public)
    /admin/v1/*, GET /v1/usage                        admin API and a tenant's own usage (gateway/admin/)
    GET  /openapi.json                                the generated OpenAPI document (gateway/openapi.py)
    GET  /, /static/*                                 the playground (gateway/playground.py; public)
    GET  /admin                                       the operator dashboard page (gateway/playground.py; public; its data needs the admin key)

Request handling order (each step's failure is an OpenAI error object):
auth (tenancy, when configured) -> body (413 over ``max_body_bytes``,
chunked bodies included, counted while reading) -> JSON/types (400) ->
model (404, resolved in the catalog for the tenant) -> ranges (400, ``param`` named) -> template + tokenize (400) ->
context length (400 ``context_length_exceeded`` for a prompt that fills it, 400 ``invalid_value`` naming
max_tokens for a limit that does not fit after the prompt) -> the ``CallResponse``
producer: admission (429), backend pick (503), generation.

Errors are rendered from ``gateway.errors`` (``APIError.body()``, status, headers; Ollama's shape under
``/api/``), every client error with a code (docs/errors.md): unknown routes are 404 ``unknown_route``; a
method a route does not have (``TRACE``, ``FOO``, ``DELETE`` on a POST route) is 405 ``method_not_allowed``
with ``Allow`` listing the methods of every route on that path, ``OPTIONS`` included (RFC 9110 section
15.5.6); ``OPTIONS`` itself is answered by the CORS middleware with the same ``Allow``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, Mount, Route

from gateway.admin.backends import backend_routes
from gateway.admin.routes import admin_routes, usage_routes
from gateway.errors import APIError, InternalError, MethodNotAllowed, NotFound
from gateway.inspector.routes import inspect_routes
from gateway.middleware.asgi import ASGIApp, Message, Receive, Scope, Send
from gateway.middleware.auth import AuthMiddleware
from gateway.middleware.body import BodyGuard
from gateway.middleware.cors import CORSMiddleware, allow_header
from gateway.middleware.drain import DrainGate
from gateway.middleware.hops import HopGuard
from gateway.observability.middleware import ObservabilityMiddleware
from gateway.observability.record import get_record
from gateway.ollama.routes import OllamaAPI
from gateway.openai.models import list_models, retrieve_model
from gateway.openai.routes import chat_completions, completions
from gateway.openapi import openapi_routes
from gateway.playground import playground_routes
from gateway.probes import admin_stats, health, healthz, readyz
from gateway.state import Gateway

log = logging.getLogger("gateway")


# ----------------------------------------------------------------------------- error rendering


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    get_record(request).set_error(exc.type, exc.code)
    return JSONResponse(exc.body_for(request.url.path), status_code=exc.status, headers=exc.headers or None)


def route_methods(routes: Sequence[BaseRoute], path: str) -> frozenset[str] | None:
    """The methods the routes on ``path`` serve, together (``HEAD`` with ``GET``; a mounted app without routes,
    the static files, serves ``GET`` and ``HEAD``), or None when no route has that path."""
    scope: Scope = {"type": "http", "path": path, "root_path": "", "method": "GET"}
    return _methods(routes, scope)


def _methods(routes: Sequence[BaseRoute], scope: Scope) -> frozenset[str] | None:
    found: set[str] | None = None
    for route in routes:
        match, child = route.matches(scope)
        if match == Match.NONE:
            continue
        if isinstance(route, Mount):
            inner = _methods(route.routes, {**scope, **child}) if route.routes else frozenset({"GET", "HEAD"})
        elif isinstance(route, Route):
            inner = frozenset(route.methods or ())
        else:
            inner = None
        if inner is not None:
            found = (found or set()) | inner
    return None if found is None else frozenset(found)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 404:
        err: APIError = NotFound(f"Unknown route: {request.method} {path}", code="unknown_route")
    elif exc.status_code == 405:
        methods = route_methods(request.app.routes, request.scope["path"]) or frozenset()
        err = MethodNotAllowed(
            f"Method {request.method} is not allowed on {path}.", headers={"allow": allow_header(methods)}
        )
    else:
        err = APIError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
    get_record(request).set_error(err.type, err.code)
    headers = err.headers if err.status == 405 else dict(exc.headers or {})
    return JSONResponse(err.body_for(path), status_code=err.status, headers=headers or None)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    err = InternalError("The server had an error while processing your request.")
    get_record(request).set_error(err.type, err.code)
    return JSONResponse(err.body(), status_code=500)


@dataclass(frozen=True)
class GatewayApp:
    """The ASGI app to serve (``asgi``: the outermost middleware) and the drain gate inside it (the server
    waits on ``drain.idle()`` after a signal). Callable as the ASGI app itself."""

    asgi: ASGIApp
    drain: DrainGate
    starlette: Starlette

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, _closing_safe(send))


def _closing_safe(send: Send) -> Send:
    """``send`` that drops what is left of a response once the server is closing its connection.

    hypercorn's trio server shuts the socket's write side (``send_eof``, outside its send lock) when the
    client closes while a response is still being written, e.g. a 413 to a client that stops sending an
    oversized body; the response's next write then raises ``trio.BusyResourceError`` or
    ``trio.BrokenResourceError``. The client is gone: that is a disconnect, not a server fault, so the rest
    is dropped instead of failing the request as a 500."""
    closing = False

    async def guarded(message: Message) -> None:
        nonlocal closing
        if closing:
            return
        try:
            await send(message)
        except (trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError):
            closing = True

    return guarded


def build_app(gw: Gateway) -> GatewayApp:
    """Every route and the middleware order of the gateway, declared here and nowhere else.

    Middleware, outermost first: CORS (a preflight and ``OPTIONS`` are answered before auth, ``Allow`` from
    the route table; error responses get CORS headers too, so a browser can read a 401 or 429 body) -> body
    guard (``http.body_timeout``: 408 for a body that does not arrive in time; the unread rest of a body
    drained before its response ends, until the server stops) -> drain gate (503 while draining, counts
    requests in flight) -> observability (request id, access log, request metrics: it sees 500s too) -> hop
    guard (508 ``loop_detected`` for a request whose ``Via`` names this gateway) -> Starlette's error
    middleware -> auth (every non-public path, once) -> the exception handlers -> the routes.
    """
    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        *inspect_routes(),
        Route("/health", health, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/admin/v1/stats", admin_stats, methods=["GET"]),  # before the admin mount: it wins
        *OllamaAPI(gw).routes(),
    ]
    if gw.metrics is not None:
        routes.append(Route("/metrics", gw.metrics.endpoint, methods=["GET"]))
    middleware: list[Middleware] = []
    if gw.tenancy is not None:
        # the stats route again inside the mount, so that another method on it is a 405 there (not a 404)
        admin = [Route("/stats", admin_stats, methods=["GET"]), *admin_routes(gw.tenancy)]
        admin += backend_routes(gw)  # /backends: list, drain, undrain (gateway/admin/backends.py)
        routes += [Mount("/admin/v1", routes=admin), *usage_routes(gw.tenancy)]
        middleware.append(Middleware(AuthMiddleware, tenants=gw.tenancy))
    routes += [*openapi_routes(), *playground_routes()]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.gateway = gw
    app.router.redirect_slashes = False  # a 307 built from the Host header would be an open redirect
    hops = HopGuard(app)  # 508 for a request that came back here (gateway/middleware/hops.py)
    observed = ObservabilityMiddleware(
        hops, gw.metrics, log_content=gw.settings.observability.log_content, routes=app.routes
    )
    drain = DrainGate(observed, gw.catalog)
    guarded = BodyGuard(drain, timeout=gw.config.body_timeout, stopping=drain.stopping)

    def methods_for(path: str) -> frozenset[str] | None:
        return route_methods(app.routes, path)

    cors = CORSMiddleware(guarded, origins=gw.config.cors_origins, methods_for=methods_for)
    return GatewayApp(cors, drain, app)
