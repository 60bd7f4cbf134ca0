"""The gateway's ASGI app: every route and the middleware order (``build_app``), and error rendering.

Routes (all declared in ``build_app``):
    POST /v1/chat/completions, POST /v1/completions   OpenAI (gateway/openai/; stream or not, docs/gateway.md)
    GET  /v1/models, /v1/models/{model_id}            the model card per served name (gateway/openai/models.py)
    GET  /health, /healthz, /readyz                   probes (gateway/probes.py; public)
    GET  /admin/v1/stats                              engine counters (admin key; gateway/probes.py)
    /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version   Ollama (gateway/ollama/)
    GET  /metrics                                     Prometheus (gateway/observability/metrics.py; public)
    /admin/v1/*, GET /v1/usage                        admin API and a tenant's own usage (gateway/admin/)
    GET  /openapi.json                                the generated OpenAPI document (gateway/openapi.py)
    GET  /, /static/*                                 the playground (gateway/playground.py; public)

Request handling order (each step's failure is an OpenAI error object):
auth (tenancy, when configured) -> body (413 over ``max_body_bytes``,
chunked bodies included, counted while reading) -> JSON/types (400) ->
model (404) -> ranges (400, ``param`` named) -> template + tokenize (400) ->
context length (400 ``context_length_exceeded`` for a prompt that fills it, 400 ``invalid_value`` naming
max_tokens for a limit that does not fit after the prompt) -> the ``CallResponse``
producer: admission (429), backend pick (503), generation.

Errors are rendered from ``gateway.errors`` (``APIError.body()``, status, headers);
unknown routes are 404 and wrong methods 405, in the same shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from gateway.admin.routes import admin_routes, usage_routes
from gateway.errors import APIError, InternalError, NotFound
from gateway.middleware.asgi import ASGIApp, Message, Receive, Scope, Send
from gateway.middleware.auth import AuthMiddleware
from gateway.middleware.cors import CORSMiddleware
from gateway.middleware.drain import DrainGate
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


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: APIError = NotFound(f"Unknown route: {request.method} {request.url.path}", code="unknown_route")
    else:
        err = APIError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
    get_record(request).set_error(err.type, err.code)
    body = err.body_for(request.url.path)
    return JSONResponse(body, status_code=err.status, headers=dict(exc.headers or {}) or None)


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

    Middleware, outermost first: CORS (a preflight is answered before auth; error responses get CORS headers
    too, so a browser can read a 401 or 429 body) -> drain gate (503 while draining, counts requests in
    flight) -> observability (request id, access log, request metrics: it sees 500s too) -> Starlette's error
    middleware -> auth (every non-public path, once) -> the exception handlers -> the routes.
    """
    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
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
        routes += [Mount("/admin/v1", routes=admin_routes(gw.tenancy)), *usage_routes(gw.tenancy)]
        middleware.append(Middleware(AuthMiddleware, tenants=gw.tenancy))
    routes += [*openapi_routes(), *playground_routes()]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.gateway = gw
    app.router.redirect_slashes = False  # a 307 built from the Host header would be an open redirect
    observed = ObservabilityMiddleware(app, gw.metrics, log_content=gw.settings.observability.log_content)
    drain = DrainGate(observed, gw.pool)
    return GatewayApp(CORSMiddleware(drain, origins=gw.config.cors_origins), drain, app)
