"""The OpenAPI 3.1 document (``GET /openapi.json``), generated from one route table and the msgspec types.

:data:`ROUTES` declares every route the gateway serves: method, path, who may call it, the request body type,
the response type and the error statuses. The /v1 and admin schemas are the very msgspec Structs the handlers
decode and encode (``msgspec.json.schema_components``), so the document cannot drift from the code; a test
checks that every route of the Starlette app is in the table. The Ollama bodies, the model objects, the
probes and the engine stats are built as dicts by their handlers: the Structs below describe them (members
the handlers always write are required; the request bodies admit members they ignore, as Ollama does).

Errors: OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` everywhere but under ``/api/``,
where they are Ollama's ``{"error": message, "type", "code"}`` (https://platform.openai.com/docs/guides/error-
codes; ollama docs/api.md). Each operation lists the statuses it answers: its own (``errors``), 400, 408
(the body did not arrive within ``--body-timeout``) and 413 for every route that reads a body, the key
check's (401 tenant, 401/403 admin) and, with ``admitted``, the admission's 429, whose rate-limit headers are
declared (https://platform.openai.com/docs/guides/rate-limits). A 5xx other than 503 is a fault, never
declared. Spec followed: https://spec.openapis.org/oas/v3.1.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.admin import schemas as admin
from gateway.admin.backends import Backend, BackendList
from gateway.admin.routes import LeasesCleared
from gateway.inspector.record import InspectRecord
from gateway.openai.schemas import ChatChunk, ChatCompletion, ChatRequest, Completion, CompletionRequest
from gateway.probes import STATS_FIELDS
from ratelimit.core import RATE_LIMIT_HEADERS

Caller = Literal["public", "tenant", "admin"]
JSON = "application/json"
Opt = int | UnsetType  # a member the handler writes only in some answers


ErrorObject = msgspec.defstruct(
    "ErrorObject",
    [("message", str), ("type", str), ("param", str | None), ("code", str | None)],
    kw_only=True,
)


class Error(Struct, kw_only=True):
    """OpenAI's error body; every 4xx and 5xx answer off ``/api/`` has it."""

    error: ErrorObject


class OllamaError(Struct, kw_only=True):
    """Ollama's error body (the client raises ``ResponseError(error, status_code)``); ``type`` and ``code``
    are OpenAI's."""

    error: str
    type: str
    code: str | None


Model = msgspec.defstruct(
    "Model",  # OpenAI's Model (id, object, created: UNIX seconds, owned_by) and the model card
    [("id", str), ("object", Literal["model"]), ("created", int), ("owned_by", str), ("context_length", int),
     ("max_model_len", int), ("quantization", str | None), *((k, str) for k in ("dtype", "device",
     "attention_backend", "architecture")), ("vocab_size", int)],
    kw_only=True,
)  # fmt: skip


ModelList = msgspec.defstruct("ModelList", [("object", Literal["list"]), ("data", list[Model])], kw_only=True)
Status = msgspec.defstruct("Status", [("status", str)])
EngineStats = msgspec.defstruct(
    "EngineStats",
    [*((f, int) for f in STATS_FIELDS), ("spec_accepted_per_pos", list[int]), ("device", str | None),
     ("attention_backend", str | None), ("backends", list[dict[str, Any]]), ("draining", bool)],
    kw_only=True,
)  # fmt: skip


class OllamaMessage(Struct, kw_only=True):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty")
OllamaOptions = msgspec.defstruct(
    "OllamaOptions",  # the options mapped (others, e.g. num_ctx, are ignored); num_predict < 0: no limit
    [*((k, float | None, None) for k in _FLOATS), *((k, int | None, None) for k in ("top_k", "seed", "num_predict")),
     ("stop", str | list[str] | None, None), ("tool_choice", str | dict[str, Any] | None, None),
     ("speculative", bool | None, None)],
    kw_only=True,
)  # fmt: skip


class _OllamaRequest(Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    stream: bool = True
    format: str | dict[str, Any] | None = None  # "json", "" or a JSON Schema
    options: OllamaOptions | None = None
    keep_alive: int | float | str | None = None


class OllamaChatRequest(_OllamaRequest, kw_only=True):
    """POST /api/chat; no (or an empty) ``messages``: only loads the model; ``think`` is refused (400)."""

    messages: list[OllamaMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class OllamaGenerateRequest(_OllamaRequest, kw_only=True):
    """POST /api/generate; raw, template, suffix, images, context and think are refused (400)."""

    prompt: str | None = None
    system: str | None = None


class OllamaShowRequest(Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    name: str | UnsetType = UNSET  # read when ``model`` is absent, as older clients send it


_STATS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
          "eval_duration", "prompt_eval_cached_count", "queue_duration")  # fmt: skip
_OllamaAnswer = msgspec.defstruct(
    "_OllamaAnswer",  # one answer object; done_reason and the statistics (ns, tokens) only in the final one
    [("model", str), ("created_at", str), ("done", bool), ("done_reason", str | UnsetType, UNSET),
     *((k, Opt, UNSET) for k in _STATS)],
    kw_only=True,
)  # fmt: skip


class OllamaAnswerMessage(Struct, kw_only=True):
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET


class OllamaChatAnswer(_OllamaAnswer, kw_only=True):
    message: OllamaAnswerMessage


class OllamaGenerateAnswer(_OllamaAnswer, kw_only=True):
    response: str


class OllamaModel(Struct, kw_only=True):
    """A model of /api/tags (size in bytes; /api/ps adds expires_at, size_vram, context_length)."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: dict[str, Any]
    expires_at: str | UnsetType = UNSET
    size_vram: Opt = UNSET
    context_length: Opt = UNSET


OllamaModels = msgspec.defstruct("OllamaModels", [("models", list[OllamaModel])])
OllamaShow = msgspec.defstruct(
    "OllamaShow",
    [("modified_at", str), *((k, dict[str, Any]) for k in ("details", "model_info")),
     *((k, str) for k in ("template", "parameters", "license")), ("capabilities", list[str])],
    kw_only=True,
)  # fmt: skip


OllamaVersion = msgspec.defstruct("OllamaVersion", [("version", str)])
FREE_OBJECT: dict[str, object] = {"type": "object", "description": "filter config (docs/filters.md)"}


@dataclass(frozen=True)
class Operation:
    """One route. ``request``/``response``: msgspec Structs, a JSON Schema dict, or None (no JSON body);
    ``stream``: the media type of the streamed variant (its items typed ``stream_item``); ``errors``: the
    statuses besides those :func:`error_statuses` adds."""

    method: str
    path: str
    summary: str
    caller: Caller
    request: type | dict[str, Any] | None = None
    response: type | dict[str, Any] | None = None
    status: int = 200
    errors: tuple[int, ...] = ()
    media: str = JSON
    stream: str | None = None
    stream_item: type | None = None
    query: tuple[str, ...] = ()
    admitted: bool = False
    body_required: bool = True

    @property
    def reads_body(self) -> bool:
        return self.method in ("POST", "PUT", "PATCH")

    @property
    def error_type(self) -> type:
        """The error body of this route: Ollama's under /api/, else OpenAI's."""
        return OllamaError if self.path.startswith("/api/") else Error


_GEN = (404, 503)
_TENANT, _BACKEND = "/admin/v1/tenants/{tenant_id}", "/admin/v1/backends/{backend_id}"
_NDJSON = "application/x-ndjson"
ROUTES: tuple[Operation, ...] = (
    Operation("POST", "/v1/chat/completions", "Create a chat completion (OpenAI)", "tenant", ChatRequest,
              ChatCompletion, errors=_GEN, stream="text/event-stream", stream_item=ChatChunk, admitted=True),
    Operation("POST", "/v1/completions", "Create a completion (OpenAI legacy)", "tenant", CompletionRequest,
              Completion, errors=_GEN, stream="text/event-stream", stream_item=Completion, admitted=True),
    Operation("GET", "/v1/models", "List models, each with the model card", "tenant", response=ModelList,
              errors=(503,)),
    Operation("GET", "/v1/models/{model_id}", "Retrieve a model", "tenant", response=Model, errors=(404, 503)),
    Operation("GET", "/v1/inspect/{request_id}", "A request's inspection record (gateway extension)", "tenant",
              response=InspectRecord, errors=(404,)),
    Operation("GET", "/v1/usage", "The calling tenant's own usage", "tenant", response=admin.Usage,
              errors=(400,), query=("since", "until")),
    Operation("POST", "/api/chat", "Chat (Ollama)", "tenant", OllamaChatRequest, OllamaChatAnswer,
              errors=_GEN, stream=_NDJSON, stream_item=OllamaChatAnswer, admitted=True),
    Operation("POST", "/api/generate", "Generate (Ollama)", "tenant", OllamaGenerateRequest,
              OllamaGenerateAnswer, errors=_GEN, stream=_NDJSON, stream_item=OllamaGenerateAnswer,
              admitted=True),
    Operation("GET", "/api/tags", "Local models (Ollama)", "tenant", response=OllamaModels),
    Operation("GET", "/api/ps", "Running models (Ollama)", "tenant", response=OllamaModels),
    Operation("POST", "/api/show", "Model details (Ollama)", "tenant", OllamaShowRequest, OllamaShow,
              errors=(404,)),
    Operation("GET", "/api/version", "Version (Ollama)", "public", response=OllamaVersion),
    Operation("GET", "/health", "Liveness (as vLLM's): 200, empty body", "public", media=""),
    Operation("GET", "/healthz", "Liveness", "public", response=Status),
    Operation("GET", "/readyz", "Readiness: a backend is ready and the gateway is not draining", "public",
              response=Status, errors=(503,)),
    Operation("GET", "/metrics", "Prometheus metrics (text exposition format)", "public",
              media="text/plain"),
    Operation("GET", "/openapi.json", "This document", "public", response={"type": "object"}),
    Operation("GET", "/", "The browser playground", "public", media="text/html"),
    Operation("GET", "/admin", "The operator dashboard page (its data needs the admin key)", "public", media="text/html"),
    Operation("GET", "/static/{path}", "The playground's files", "public", errors=(404,), media=""),
    Operation("GET", "/admin/v1/stats", "Engine counters of every backend", "admin", response=EngineStats),
    Operation("POST", "/admin/v1/tenants", "Create a tenant", "admin", admin.TenantCreate, admin.Tenant,
              201, (409,)),
    Operation("GET", "/admin/v1/tenants", "List tenants", "admin", response=admin.TenantList),
    Operation("GET", _TENANT, "Get a tenant", "admin", response=admin.Tenant, errors=(404,)),
    Operation("PATCH", _TENANT, "Change a tenant (the members given)", "admin", admin.TenantPatch,
              admin.Tenant, errors=(404, 409)),
    Operation("DELETE", _TENANT, "Delete a tenant (keys revoked, usage kept)", "admin",
              response=admin.TenantDeleted, errors=(404,)),
    Operation("POST", f"{_TENANT}/keys", "Create an API key (the secret is shown once)", "admin",
              admin.KeyCreate, admin.ApiKeyCreated, 201, (404,), body_required=False),
    Operation("GET", f"{_TENANT}/keys", "List a tenant's keys (prefixes only)", "admin",
              response=admin.KeyList, errors=(404,)),
    Operation("GET", "/admin/v1/keys/{key_id}", "Get a key (prefix only)", "admin", response=admin.ApiKey,
              errors=(404,)),
    Operation("PATCH", "/admin/v1/keys/{key_id}", "Change a key's name, expiry or own limits", "admin",
              admin.KeyPatch, admin.ApiKey, errors=(404,)),
    Operation("DELETE", "/admin/v1/keys/{key_id}", "Revoke a key", "admin", response=admin.ApiKeyRevoked,
              errors=(404,)),
    Operation("GET", f"{_TENANT}/limits", "Get a tenant's limits", "admin", response=admin.LimitsObject,
              errors=(404,)),
    Operation("PUT", f"{_TENANT}/limits", "Replace the limits (the whole object; applies at once)", "admin",
              admin.LimitsPut, admin.LimitsObject, errors=(404,)),
    Operation("PATCH", f"{_TENANT}/limits", "Change some limits (the others stay; applies at once)", "admin",
              admin.LimitsPatch, admin.LimitsObject, errors=(404,)),
    Operation("GET", f"{_TENANT}/usage", "Usage totals and per-day sums", "admin", response=admin.Usage,
              errors=(400, 404), query=("since", "until")),
    Operation("GET", f"{_TENANT}/filters", "Get the tenant's filter config", "admin", response=FREE_OBJECT,
              errors=(404,)),
    Operation("PUT", f"{_TENANT}/filters", "Replace the filter config (validated)", "admin", FREE_OBJECT,
              FREE_OBJECT, errors=(404,)),
    Operation("DELETE", f"{_TENANT}/leases", "Free the tenant's concurrency slots in every gateway", "admin",
              response=LeasesCleared, errors=(404,)),
    Operation("GET", "/admin/v1/spend", "Tokens per tenant, key, model or day over a time range", "admin",
              response=admin.Spend, errors=(400, 404, 503),
              query=("since", "until", "tenant_id", "key_id", "model", "group_by")),
    Operation("GET", "/admin/v1/backends", "Every backend: state, load, engine stats", "admin", response=BackendList),
    Operation("POST", f"{_BACKEND}/drain", "Route no new request to a backend (wait: until none in flight)",
              "admin", response=Backend, errors=(400, 404), query=("wait",)),
    Operation("POST", f"{_BACKEND}/undrain", "Route requests to a drained backend again", "admin",
              response=Backend, errors=(404,)),
)  # fmt: skip

ERROR_TEXT = {
    400: "Invalid request: the body, a parameter or a value (param names it)",
    401: "Missing or wrong key",
    403: "A tenant key on an admin route",
    404: "Unknown model, tenant, key, backend or file",
    408: "The request body did not arrive within the body timeout (the connection is closed)",
    409: "Tenant name already taken",
    413: "Request body too large",
    429: "Rate limited (rate_limit_exceeded) or daily quota spent (insufficient_quota)",
    503: "No backend ready, draining, the shared rate limiter or the tenancy store unavailable",
}
QUERY_TEXT = {"since": "UNIX seconds or ISO-8601 (UTC), inclusive", "until": "the same, exclusive",
              "tenant_id": "only this tenant's rows (id or name)", "key_id": "only this key's rows",
              "model": "only this model's rows", "group_by": "tenant (default), key, model or day",
              "wait": "seconds to wait for the requests in flight to finish (0-300; default 0)"}  # fmt: skip


def error_statuses(op: Operation) -> tuple[int, ...]:
    """Every error status ``op`` may answer, sorted."""
    auth = {"public": (), "tenant": (401,), "admin": (401, 403)}[op.caller]
    body = (400, 408, 413) if op.reads_body else ()
    return tuple(sorted({*op.errors, *auth, *body, *((429,) if op.admitted else ())}))


def _schema(t: type | dict[str, Any]) -> dict[str, object]:
    return dict(t) if isinstance(t, dict) else {"$ref": f"#/components/schemas/{t.__name__}"}


def _headers(names: tuple[str, ...]) -> dict[str, object]:
    return {h: {"schema": {"type": "string"}} for h in names}


def _operation(op: Operation) -> dict[str, object]:
    content: dict[str, object] = {}
    if op.media:
        content[op.media] = {"schema": _schema(op.response)} if op.response is not None else {}
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
            "content": {JSON: {"schema": _schema(op.error_type)}},
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
        out["requestBody"] = {
            "required": op.body_required,
            "content": {JSON: {"schema": _schema(op.request)}},
        }
    return out


_INFO = {"title": "llm-gateway", "version": "0.1.0",
         "description": "OpenAI- and Ollama-compatible chat gateway; multi-tenant admin API under /admin/v1."}  # fmt: skip
_SECURITY = {"tenantKey": {"type": "http", "scheme": "bearer", "description": "a tenant API key (sk-gw-...)"},
             "adminKey": {"type": "http", "scheme": "bearer", "description": "the gateway's admin key"}}  # fmt: skip


def openapi_spec() -> dict[str, object]:
    """The OpenAPI 3.1 document of :data:`ROUTES` (a fresh dict each call)."""
    types = {t for op in ROUTES for t in (op.request, op.response, op.stream_item, op.error_type)
             if isinstance(t, type)}  # fmt: skip
    _, schemas = msgspec.json.schema_components(
        sorted(types, key=lambda t: t.__name__), ref_template="#/components/schemas/{name}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for op in ROUTES:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": dict(_INFO),
        "components": {"securitySchemes": {k: dict(v) for k, v in _SECURITY.items()}, "schemas": schemas},
        "paths": paths,
    }


_DOCUMENT = msgspec.json.encode(openapi_spec())


async def openapi(request: Request) -> Response:
    """GET /openapi.json (public)."""
    return Response(_DOCUMENT, media_type=JSON)


def openapi_routes() -> list[BaseRoute]:
    return [Route("/openapi.json", openapi, methods=["GET"])]
