"""The Starlette app: OpenAI-compatible routes, health probes, admin stats, error rendering.

Routes:
    POST /v1/chat/completions, POST /v1/completions   (stream or not; see docs/gateway.md)
    GET  /v1/models                                   model card (context length, quantization, device...)
    GET  /v1/models/{model_id}                        one model, the same object as its /v1/models entry; 404 if unknown
    GET  /health                                      liveness as in vLLM: 200, empty body, while the process runs
    GET  /healthz                                     200 while the process runs
    GET  /readyz                                      200 when a backend is ready and we are not draining, else 503
    GET  /admin/v1/stats                              engine counters (Bearer admin key)

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

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import APIError, InternalError, NotFound
from gateway.openai.models import list_models, retrieve_model
from gateway.openai.routes import chat_completions, completions
from gateway.probes import admin_stats, health, healthz, readyz
from gateway.request_log import get_record
from gateway.state import Gateway

log = logging.getLogger("gateway")


# ----------------------------------------------------------------------------- error rendering


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    get_record(request).set_error(exc.type, exc.code)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: APIError = NotFound(f"Unknown route: {request.method} {request.url.path}", code="unknown_route")
    else:
        err = APIError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
    return JSONResponse(err.body(), status_code=err.status, headers=dict(exc.headers or {}) or None)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    err = InternalError("The server had an error while processing your request.")
    return JSONResponse(err.body(), status_code=500)


def build_app(gw: Gateway, *, extra_routes: list | None = None, middleware: list | None = None) -> Starlette:
    """The Starlette app for ``gw`` (``app.state.gateway``). ``extra_routes`` (e.g. tenancy admin routes) are appended."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/admin/v1/stats", admin_stats, methods=["GET"]),
        *(extra_routes or []),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.gateway = gw
    app.router.redirect_slashes = False  # a 307 built from the Host header would be an open redirect
    # observability: /metrics, Ollama API routes, x-request-id, access log (outermost wrapper, forwards attributes)
    from gateway.metrics import instrument

    return instrument(
        app,
        gw,
        tenant_label=gw.config.metrics_tenant_label,
        log_content=gw.config.log_content,
        access_log=gw.config.access_log,
    )
