"""The OpenAPI 3.1 document (``GET /openapi.json``), generated from one route table and the msgspec types.

:data:`ROUTES` declares every route the gateway serves: method, path, who may call it, the request body type,
the response type and the error statuses. The schemas are the very msgspec Structs the handlers decode and
encode (``msgspec.json.schema_components``), so the document cannot drift from the code; a test checks that
every route of the Starlette app is in the table. Error responses all have OpenAI's shape
(https://platform.openai.com/docs/guides/error-codes); 429s carry the rate-limit headers
(https://platform.openai.com/docs/guides/rate-limits). Spec followed: https://spec.openapis.org/oas/v3.1.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.admin import schemas as admin
from gateway.openai.schemas import ChatChunk, ChatCompletion, ChatRequest, Completion, CompletionRequest
from ratelimit.core import RATE_LIMIT_HEADERS

Caller = Literal["public", "tenant", "admin"]
JSON = "application/json"


class ErrorObject(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(msgspec.Struct, kw_only=True):
    """OpenAI's error body; every 4xx and 5xx answer has it."""

    error: ErrorObject


@dataclass(frozen=True)
class Operation:
    """One route. ``request``/``response``: msgspec Structs (or None: no JSON body / a free-form one described
    by ``note``); ``stream``: the media type of the streamed variant (its items typed ``stream_item``);
    ``errors``: the statuses besides those of the caller's key check (401 tenant, 401/403 admin) and, with
    ``admitted``, the admission's 429."""

    method: str
    path: str
    summary: str
    caller: Caller
    request: type | None = None
    response: type | None = None
    status: int = 200
    errors: tuple[int, ...] = ()
    media: str = JSON
    stream: str | None = None
    stream_item: type | None = None
    query: tuple[str, ...] = ()
    admitted: bool = False
    body_required: bool = True


_GEN = (400, 404, 413, 503)
_TENANT = "/admin/v1/tenants/{tenant_id}"
ROUTES: tuple[Operation, ...] = (
    Operation("POST", "/v1/chat/completions", "Create a chat completion (OpenAI)", "tenant", ChatRequest,
              ChatCompletion, errors=_GEN, stream="text/event-stream", stream_item=ChatChunk, admitted=True),
    Operation("POST", "/v1/completions", "Create a completion (OpenAI legacy)", "tenant", CompletionRequest,
              Completion, errors=_GEN, stream="text/event-stream", stream_item=Completion, admitted=True),
    Operation("GET", "/v1/models", "List models, each with the model card", "tenant", errors=(503,)),
    Operation("GET", "/v1/models/{model_id}", "Retrieve a model", "tenant", errors=(404, 503)),
    Operation("GET", "/v1/usage", "The calling tenant's own usage", "tenant", response=admin.Usage,
              errors=(400,), query=("since", "until")),
    Operation("POST", "/api/chat", "Chat (Ollama)", "tenant", errors=_GEN, stream="application/x-ndjson",
              admitted=True),
    Operation("POST", "/api/generate", "Generate (Ollama)", "tenant", errors=_GEN,
              stream="application/x-ndjson", admitted=True),
    Operation("GET", "/api/tags", "Local models (Ollama)", "tenant"),
    Operation("GET", "/api/ps", "Running models (Ollama)", "tenant"),
    Operation("POST", "/api/show", "Model details (Ollama)", "tenant", errors=(400, 404, 413)),
    Operation("GET", "/api/version", "Version (Ollama)", "public"),
    Operation("GET", "/health", "Liveness (as vLLM's): 200, empty body", "public", media=""),
    Operation("GET", "/healthz", "Liveness", "public"),
    Operation("GET", "/readyz", "Readiness: a backend is ready and the gateway is not draining", "public",
              errors=(503,)),
    Operation("GET", "/metrics", "Prometheus metrics (text exposition format)", "public",
              media="text/plain"),
    Operation("GET", "/openapi.json", "This document", "public"),
    Operation("GET", "/", "The browser playground", "public", media="text/html"),
    Operation("GET", "/static/{path}", "The playground's files", "public", errors=(404,), media=""),
    Operation("GET", "/admin/v1/stats", "Engine counters of every backend", "admin"),
    Operation("POST", "/admin/v1/tenants", "Create a tenant", "admin", admin.TenantCreate, admin.Tenant,
              201, (400, 409, 413)),
    Operation("GET", "/admin/v1/tenants", "List tenants", "admin", response=admin.TenantList),
    Operation("GET", _TENANT, "Get a tenant", "admin", response=admin.Tenant, errors=(404,)),
    Operation("PATCH", _TENANT, "Change a tenant (the members given)", "admin", admin.TenantPatch,
              admin.Tenant, errors=(400, 404, 409, 413)),
    Operation("DELETE", _TENANT, "Delete a tenant (keys revoked, usage kept)", "admin",
              response=admin.TenantDeleted, errors=(404,)),
    Operation("POST", f"{_TENANT}/keys", "Create an API key (the secret is shown once)", "admin",
              admin.KeyCreate, admin.ApiKeyCreated, 201, (400, 404, 413), body_required=False),
    Operation("GET", f"{_TENANT}/keys", "List a tenant's keys (prefixes only)", "admin",
              response=admin.KeyList, errors=(404,)),
    Operation("GET", "/admin/v1/keys/{key_id}", "Get a key (prefix only)", "admin", response=admin.ApiKey,
              errors=(404,)),
    Operation("PATCH", "/admin/v1/keys/{key_id}", "Change a key's name, expiry or own limits", "admin",
              admin.KeyPatch, admin.ApiKey, errors=(400, 404, 413)),
    Operation("DELETE", "/admin/v1/keys/{key_id}", "Revoke a key", "admin", response=admin.ApiKeyRevoked,
              errors=(404,)),
    Operation("GET", f"{_TENANT}/limits", "Get a tenant's limits", "admin", response=admin.LimitsObject,
              errors=(404,)),
    Operation("PUT", f"{_TENANT}/limits", "Replace the limits (the whole object; applies at once)", "admin",
              admin.LimitsPut, admin.LimitsObject, errors=(400, 404, 413)),
    Operation("PATCH", f"{_TENANT}/limits", "Change some limits (the others stay; applies at once)", "admin",
              admin.LimitsPatch, admin.LimitsObject, errors=(400, 404, 413)),
    Operation("GET", f"{_TENANT}/usage", "Usage totals and per-day sums", "admin", response=admin.Usage,
              errors=(400, 404), query=("since", "until")),
    Operation("GET", f"{_TENANT}/filters", "Get the tenant's filter config", "admin", errors=(404,)),
    Operation("PUT", f"{_TENANT}/filters", "Replace the filter config (validated)", "admin",
              errors=(400, 404, 413)),
)  # fmt: skip

ERROR_TEXT = {
    400: "Invalid request: the body, a parameter or a value (param names it)",
    401: "Missing or wrong key",
    403: "A tenant key on an admin route",
    404: "Unknown model, tenant, key or file",
    409: "Tenant name already taken",
    413: "Request body too large",
    429: "Rate limited (rate_limit_exceeded) or daily quota spent (insufficient_quota)",
    503: "No backend ready, draining, or the shared rate limiter unavailable",
}
QUERY_TEXT = {"since": "UNIX seconds or ISO-8601 (UTC), inclusive", "until": "the same, exclusive"}


def error_statuses(op: Operation) -> tuple[int, ...]:
    """Every error status ``op`` may answer, sorted."""
    auth = {"public": (), "tenant": (401,), "admin": (401, 403)}[op.caller]
    return tuple(sorted({*op.errors, *auth, *((429,) if op.admitted else ())}))


def _ref(t: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{t.__name__}"}


def _headers(names: tuple[str, ...]) -> dict[str, object]:
    return {h: {"schema": {"type": "string"}} for h in names}


def _operation(op: Operation) -> dict[str, object]:
    content: dict[str, object] = {}
    if op.media:
        content[op.media] = {"schema": _ref(op.response)} if op.response else {}
    if op.stream:
        item = {"description": f"items: {op.stream_item.__name__}"} if op.stream_item else {}
        content[op.stream] = {"schema": {"type": "string", **item}}
    ok: dict[str, object] = {"description": "OK", **({"content": content} if content else {})}
    if op.admitted:
        ok["headers"] = _headers(RATE_LIMIT_HEADERS)
    responses: dict[str, object] = {str(op.status): ok}
    for status in error_statuses(op):
        err: dict[str, object] = {
            "description": ERROR_TEXT[status],
            "content": {JSON: {"schema": _ref(Error)}},
        }
        if status == 429:
            err["headers"] = _headers(
                (*RATE_LIMIT_HEADERS, "retry-after", "retry-after-ms", "x-should-retry")
            )
        responses[str(status)] = err
    out: dict[str, object] = {"summary": op.summary, "responses": responses}
    if op.caller != "public":
        out["security"] = [{f"{op.caller}Key": []}]
    params = [
        {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
        for p in (seg[1:-1] for seg in op.path.split("/") if seg.startswith("{"))
    ]
    params += [
        {"name": q, "in": "query", "schema": {"type": "string"}, "description": QUERY_TEXT[q]}
        for q in op.query
    ]
    if params:
        out["parameters"] = params
    if op.request is not None:
        out["requestBody"] = {"required": op.body_required, "content": {JSON: {"schema": _ref(op.request)}}}
    return out


def openapi_spec() -> dict[str, object]:
    """The OpenAPI 3.1 document of :data:`ROUTES` (a fresh dict each call)."""
    types = {t for op in ROUTES for t in (op.request, op.response, op.stream_item) if t is not None}
    _, schemas = msgspec.json.schema_components(
        sorted({*types, Error}, key=lambda t: t.__name__), ref_template="#/components/schemas/{name}"
    )
    paths: dict[str, dict[str, object]] = {}
    for op in ROUTES:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "llm-gateway",
            "version": "0.1.0",
            "description": "OpenAI- and Ollama-compatible chat gateway; multi-tenant admin API under /admin/v1.",
        },
        "components": {
            "securitySchemes": {
                "tenantKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a tenant API key (sk-gw-...)",
                },
                "adminKey": {"type": "http", "scheme": "bearer", "description": "the gateway's admin key"},
            },
            "schemas": schemas,
        },
        "paths": paths,
    }


_DOCUMENT = msgspec.json.encode(openapi_spec())


async def openapi(request: Request) -> Response:
    """GET /openapi.json (public)."""
    return Response(_DOCUMENT, media_type=JSON)


def openapi_routes() -> list[BaseRoute]:
    return [Route("/openapi.json", openapi, methods=["GET"])]
