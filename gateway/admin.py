"""Admin API (``/admin/v1``, admin key required) and the OpenAPI document (``/openapi.json``).

Routes (relative to the mount point ``/admin/v1``)::

    POST   /tenants                     {name, limits?, filters?, disabled?}        -> 201 tenant
    GET    /tenants                                                                  -> list of tenants
    GET    /tenants/{id}   PATCH {name?, disabled?, limits?, filters?}   DELETE      -> tenant / deleted
    POST   /tenants/{id}/keys           {name?, expires_at?, limits?}               -> 201 key (secret shown once)
    GET    /tenants/{id}/keys                                                        -> keys (prefixes only)
    DELETE /keys/{key_id}                                                            -> revoked key
    GET    /keys/{key_id}   PATCH {name?, expires_at?, limits?}                      -> key (limits: the key's own)
    GET|PUT /tenants/{id}/limits        {rpm, tpm, max_concurrent, daily_tokens, window_s?}  (null = unlimited)
    GET    /tenants/{id}/usage?since=&until=   (UNIX seconds or ISO-8601 dates/times, UTC)
    GET|PUT /tenants/{id}/filters       opaque JSON, validated by gateway.filters.parse_config

``{id}`` accepts a tenant id (``tn_...``) or its name. Every change invalidates the tenancy cache, so it
applies to the next request at once. Errors: 400 (bad body), 401/403 (admin key), 404 (unknown tenant/key),
409 (name taken), all with OpenAI's error body.
"""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from auth.store import Store
from gateway.errors import APIError, InvalidRequest, NotFound
from ratelimit.core import LIMIT_FIELDS, Limits

if TYPE_CHECKING:
    from gateway.tenancy import Tenancy

MAX_BODY = 256 * 1024


class Conflict(APIError):
    status = 409
    type = "invalid_request_error"


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _json(request: Request) -> Any:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise InvalidRequest("request body too large", status=413, code="request_too_large")
    if not body:
        return {}
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest("request body is not valid JSON", code="invalid_json") from None


def _obj(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _parse_time(v: str | None, name: str) -> float | None:
    if v is None or v == "":
        return None
    try:
        t = float(v)
    except ValueError:
        pass
    else:
        if not math.isfinite(t) or not 0 <= t < 253402300800:  # year 10000
            raise InvalidRequest(f"{name} must be finite UNIX seconds in [0, 253402300800)", param=name)
        return t
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{name} must be UNIX seconds or an ISO-8601 date/time", param=name) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _expiry(v: Any) -> float | None:
    """A key's ``expires_at`` (UNIX seconds or an ISO-8601 time; null/"" = never) as UNIX seconds.

    Raises:
        InvalidRequest: not a number/string, not finite, or not in the future (a key that is born expired
            is a mistake; revoke a key with ``DELETE /keys/{key_id}``), or past the year 9999 (param ``expires_at``).
    """
    if isinstance(v, str):
        t = _parse_time(v, "expires_at")
    elif v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
        t = v
    else:
        raise InvalidRequest(
            "expires_at must be UNIX seconds or an ISO-8601 time", param="expires_at", code="invalid_type"
        )
    if t is None:
        return None
    try:
        t = float(t)
    except OverflowError:  # an integer beyond float range
        t = math.inf if t > 0 else -math.inf
    if not math.isfinite(t) or t >= 253402300800:
        raise InvalidRequest(
            "expires_at must be finite UNIX seconds before the year 10000",
            param="expires_at",
            code="invalid_value",
        )
    if t <= time.time():
        raise InvalidRequest(
            "expires_at must be in the future (UNIX seconds or an ISO-8601 time); to disable a key, revoke it",
            param="expires_at",
            code="invalid_value",
        )
    return t


def _limits(obj: Any, param: str = "limits", base: Limits | None = None) -> Limits:
    if obj is None:
        return Limits()
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    merged = dict(obj)
    if base is not None and "window_s" not in merged:
        merged["window_s"] = base.window_s
    try:
        return Limits.from_dict(merged)
    except ValueError as e:
        raise InvalidRequest(str(e), param=param) from None


def validate_filters(obj: Any) -> Any:
    """Validate a tenant filter config with ``gateway.filters.parse_config`` when that exists; 400 on ValueError."""
    try:
        from gateway.filters import parse_config  # type: ignore[attr-defined]
    except ImportError:
        return obj
    try:
        parse_config(obj)
    except ValueError as e:
        raise InvalidRequest(f"invalid filters config: {e}", param="filters") from None
    return obj


def admin_routes(tenancy: Tenancy) -> list[Route]:
    """Starlette routes of the admin API bound to ``tenancy`` (mount under ``/admin/v1``)."""
    store = tenancy.store

    def handler(fn):
        async def endpoint(request: Request):
            try:
                await tenancy.require_admin(request)
                return await fn(request)
            except APIError as e:
                return _error(e)

        endpoint.__name__ = fn.__name__
        endpoint.__doc__ = fn.__doc__
        return endpoint

    async def tenant_or_404(request: Request):
        t = await store.call(Store.get_tenant, request.path_params["tenant_id"])
        if t is None:
            raise NotFound("No such tenant.", param="tenant_id", code="tenant_not_found")
        return t

    @handler
    async def create_tenant(request: Request):
        body = _obj(await _json(request))
        name = body.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 128:
            raise InvalidRequest("name must be a non-empty string (<= 128 chars)", param="name")
        limits = _limits(body.get("limits"))
        filters = validate_filters(body.get("filters", {}))
        try:
            t = await store.call(Store.create_tenant, name.strip(), limits, filters)
        except ValueError as e:
            raise Conflict(str(e), param="name", code="tenant_exists") from None
        if body.get("disabled"):
            t = await store.call(Store.update_tenant, t.id, disabled=True)
        tenancy.invalidate()
        return JSONResponse(t.public(), status_code=201)

    @handler
    async def list_tenants(request: Request):
        ts = await store.call(Store.list_tenants)
        return JSONResponse({"object": "list", "data": [t.public() for t in ts]})

    @handler
    async def get_tenant(request: Request):
        return JSONResponse((await tenant_or_404(request)).public())

    @handler
    async def patch_tenant(request: Request):
        t = await tenant_or_404(request)
        body = _obj(await _json(request))
        unknown = set(body) - {"name", "disabled", "limits", "filters"}
        if unknown:
            raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
        kw: dict[str, Any] = {}
        if "name" in body:
            if not isinstance(body["name"], str) or not body["name"].strip():
                raise InvalidRequest("name must be a non-empty string", param="name")
            kw["name"] = body["name"].strip()
        if "disabled" in body:
            if not isinstance(body["disabled"], bool):
                raise InvalidRequest("disabled must be a boolean", param="disabled")
            kw["disabled"] = body["disabled"]
        if "limits" in body:
            kw["limits"] = _limits(body["limits"], base=t.limits)
        if "filters" in body:
            kw["filters"] = validate_filters(body["filters"])
        try:
            t = await store.call(Store.update_tenant, t.id, **kw)
        except ValueError as e:
            raise Conflict(str(e), param="name", code="tenant_exists") from None
        tenancy.invalidate()
        return JSONResponse(t.public())

    @handler
    async def delete_tenant(request: Request):
        t = await tenant_or_404(request)
        await store.call(Store.delete_tenant, t.id)
        tenancy.invalidate()
        return JSONResponse({"id": t.id, "object": "tenant.deleted", "deleted": True})

    @handler
    async def create_key(request: Request):
        t = await tenant_or_404(request)
        body = _obj(await _json(request))
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > 128):
            raise InvalidRequest("name must be a string (<= 128 chars)", param="name")
        expires_at = _expiry(body.get("expires_at"))
        limits = _limits(body["limits"], "limits") if body.get("limits") is not None else None
        key, rec = await store.call(Store.create_key, t.id, name=name, expires_at=expires_at, limits=limits)
        return JSONResponse(
            {**rec.public(), "key": key}, status_code=201, headers={"cache-control": "no-store"}
        )

    @handler
    async def list_keys(request: Request):
        t = await tenant_or_404(request)
        ks = await store.call(Store.list_keys, t.id)
        return JSONResponse({"object": "list", "data": [k.public() for k in ks]})

    @handler
    async def revoke_key(request: Request):
        rec = await store.call(Store.revoke_key, request.path_params["key_id"])
        if rec is None:
            raise NotFound("No such API key.", param="key_id", code="key_not_found")
        tenancy.invalidate()
        return JSONResponse({**rec.public(), "revoked": True})

    @handler
    async def get_key(request: Request):
        rec = await store.call(Store.get_key, request.path_params["key_id"])
        if rec is None:
            raise NotFound("No such API key.", param="key_id", code="key_not_found")
        return JSONResponse(rec.public())

    @handler
    async def patch_key(request: Request):
        kid = request.path_params["key_id"]
        if await store.call(Store.get_key, kid) is None:
            raise NotFound("No such API key.", param="key_id", code="key_not_found")
        body = _obj(await _json(request))
        unknown = set(body) - {"name", "expires_at", "limits"}
        if unknown:
            raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
        kw: dict[str, Any] = {}
        if "name" in body:
            if body["name"] is not None and not isinstance(body["name"], str):
                raise InvalidRequest("name must be a string", param="name")
            kw["name"] = body["name"]
        if "expires_at" in body:
            kw["expires_at"] = _expiry(body["expires_at"])
        if "limits" in body:
            kw["limits"] = _limits(body["limits"], "limits") if body["limits"] is not None else None
        rec = await store.call(Store.update_key, kid, **kw)
        tenancy.invalidate()
        return JSONResponse(rec.public())

    @handler
    async def get_limits(request: Request):
        return JSONResponse((await tenant_or_404(request)).limits.to_dict())

    @handler
    async def put_limits(request: Request):
        t = await tenant_or_404(request)
        body = _obj(await _json(request))
        unknown = set(body) - {*LIMIT_FIELDS, "window_s"}
        if unknown:
            raise InvalidRequest(f"unknown limit field(s): {', '.join(sorted(unknown))}", param="limits")
        limits = _limits(
            {k: body.get(k) for k in (*LIMIT_FIELDS, "window_s") if k in body or k in LIMIT_FIELDS},
            "limits",
            base=t.limits,
        )
        t = await store.call(Store.update_tenant, t.id, limits=limits)
        tenancy.invalidate()
        return JSONResponse(t.limits.to_dict())

    @handler
    async def get_usage(request: Request):
        t = await tenant_or_404(request)
        since = _parse_time(request.query_params.get("since"), "since")
        until = _parse_time(request.query_params.get("until"), "until")
        await tenancy.ledger.flush()
        return JSONResponse(await store.call(Store.usage_summary, t.id, since, until))

    @handler
    async def get_filters(request: Request):
        return JSONResponse((await tenant_or_404(request)).filters)

    @handler
    async def put_filters(request: Request):
        t = await tenant_or_404(request)
        body = validate_filters(await _json(request))
        t = await store.call(Store.update_tenant, t.id, filters=body)
        tenancy.invalidate()
        return JSONResponse(t.filters)

    return [
        Route("/tenants", create_tenant, methods=["POST"]),
        Route("/tenants", list_tenants, methods=["GET"]),
        Route("/tenants/{tenant_id}", get_tenant, methods=["GET"]),
        Route("/tenants/{tenant_id}", patch_tenant, methods=["PATCH"]),
        Route("/tenants/{tenant_id}", delete_tenant, methods=["DELETE"]),
        Route("/tenants/{tenant_id}/keys", create_key, methods=["POST"]),
        Route("/tenants/{tenant_id}/keys", list_keys, methods=["GET"]),
        Route("/keys/{key_id}", revoke_key, methods=["DELETE"]),
        Route("/keys/{key_id}", get_key, methods=["GET"]),
        Route("/keys/{key_id}", patch_key, methods=["PATCH"]),
        Route("/tenants/{tenant_id}/limits", get_limits, methods=["GET"]),
        Route("/tenants/{tenant_id}/limits", put_limits, methods=["PUT"]),
        Route("/tenants/{tenant_id}/usage", get_usage, methods=["GET"]),
        Route("/tenants/{tenant_id}/filters", get_filters, methods=["GET"]),
        Route("/tenants/{tenant_id}/filters", put_filters, methods=["PUT"]),
    ]


def tenant_routes(tenancy: Tenancy) -> list[Route]:
    """``GET /v1/usage?since=&until=``: the calling tenant's own usage (tenant key; never another tenant's)."""

    async def my_usage(request: Request):
        try:
            p = request.scope.get("state", {}).get("principal") or await tenancy.authenticate(request)
            since = _parse_time(request.query_params.get("since"), "since")
            until = _parse_time(request.query_params.get("until"), "until")
            await tenancy.ledger.flush()
            return JSONResponse(await tenancy.store.call(Store.usage_summary, p.tenant_id, since, until))
        except APIError as e:
            return _error(e)

    return [Route("/v1/usage", my_usage, methods=["GET"])]


# ------------------------------------------------------------------------------------------------------
def _err_schema() -> dict:
    return {"$ref": "#/components/schemas/Error"}


def _resp(desc: str, schema: dict | None = None) -> dict:
    r: dict[str, Any] = {"description": desc}
    if schema is not None:
        r["content"] = {"application/json": {"schema": schema}}
    return r


def _errors(*codes: int) -> dict:
    names = {
        400: "Invalid request",
        401: "Missing or wrong key",
        403: "Key not allowed here",
        404: "Not found",
        409: "Conflict",
        429: "Rate limited / quota exhausted",
    }
    return {str(c): _resp(names[c], _err_schema()) for c in codes}


def openapi_spec() -> dict[str, Any]:
    """Hand-written OpenAPI 3.1 document of the admin API, ``/v1/usage`` and ``/v1/chat/completions``.
    The gateway may extend the returned dict (a fresh copy each call)."""
    ref = lambda n: {"$ref": f"#/components/schemas/{n}"}  # noqa: E731
    tid = {
        "name": "tenant_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": "tenant id (tn_...) or name",
    }
    admin = [{"adminKey": []}]
    tenant = [{"tenantKey": []}]
    rl_headers = {
        h: {"schema": {"type": "string"}}
        for h in (
            "x-ratelimit-limit-requests",
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-requests",
            "x-ratelimit-reset-tokens",
        )
    }
    limits_schema = {
        "type": "object",
        "properties": {
            "rpm": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": "requests per window (per minute)",
            },
            "tpm": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": "tokens per window: prompt + max_tokens reserved",
            },
            "max_concurrent": {"type": ["integer", "null"], "minimum": 0},
            "daily_tokens": {"type": ["integer", "null"], "minimum": 0, "description": "tokens per UTC day"},
            "window_s": {
                "type": "number",
                "default": 60,
                "description": "refill window of rpm/tpm in seconds",
            },
        },
    }
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "llm-gateway",
            "version": "0.1.0",
            "description": "OpenAI-compatible chat gateway; multi-tenant admin API under /admin/v1.",
        },
        "components": {
            "securitySchemes": {
                "tenantKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "tenant API key (sk-gw-...)",
                },
                "adminKey": {"type": "http", "scheme": "bearer", "description": "the gateway's admin key"},
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "null"]},
                            },
                        }
                    },
                },
                "Limits": limits_schema,
                "Tenant": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"const": "tenant"},
                        "name": {"type": "string"},
                        "disabled": {"type": "boolean"},
                        "created_at": {"type": "number"},
                        "limits": ref("Limits"),
                        "filters": {"description": "opaque filter config (see docs/filters.md)"},
                    },
                },
                "TenantCreate": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "limits": ref("Limits"),
                        "filters": {},
                        "disabled": {"type": "boolean"},
                    },
                },
                "TenantPatch": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "limits": ref("Limits"),
                        "filters": {},
                        "disabled": {"type": "boolean"},
                    },
                },
                "ApiKey": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"const": "api_key"},
                        "tenant_id": {"type": "string"},
                        "name": {"type": ["string", "null"]},
                        "prefix": {"type": "string"},
                        "created_at": {"type": "number"},
                        "expires_at": {"type": ["number", "null"]},
                        "revoked_at": {"type": ["number", "null"]},
                        "limits": {"oneOf": [ref("Limits"), {"type": "null"}]},
                    },
                },
                "ApiKeyCreated": {
                    "allOf": [
                        ref("ApiKey"),
                        {
                            "type": "object",
                            "properties": {
                                "key": {
                                    "type": "string",
                                    "description": "the secret key, shown only in this response",
                                }
                            },
                        },
                    ]
                },
                "ApiKeyCreate": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "expires_at": {
                            "type": ["number", "string", "null"],
                            "description": "UNIX seconds or ISO-8601, in the future; null = never",
                        },
                        "limits": ref("Limits"),
                    },
                },
                "UsageTotals": {
                    "type": "object",
                    "properties": {
                        k: {"type": "integer"}
                        for k in (
                            "requests",
                            "prompt_tokens",
                            "cached_tokens",
                            "completion_tokens",
                            "total_tokens",
                        )
                    },
                },
                "Usage": {
                    "type": "object",
                    "properties": {
                        "object": {"const": "usage"},
                        "tenant_id": {"type": "string"},
                        "since": {"type": ["number", "null"]},
                        "until": {"type": ["number", "null"]},
                        "totals": ref("UsageTotals"),
                        "days": {
                            "type": "array",
                            "items": {
                                "allOf": [
                                    ref("UsageTotals"),
                                    {
                                        "type": "object",
                                        "properties": {"day": {"type": "string", "format": "date"}},
                                    },
                                ]
                            },
                        },
                    },
                },
                "ChatCompletionRequest": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "properties": {
                        "model": {"type": "string"},
                        "messages": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {"role": {"type": "string"}, "content": {}},
                            },
                        },
                        "max_tokens": {"type": "integer"},
                        "max_completion_tokens": {"type": "integer"},
                        "temperature": {"type": "number"},
                        "top_p": {"type": "number"},
                        "n": {"type": "integer"},
                        "stream": {"type": "boolean"},
                        "stop": {},
                        "seed": {"type": "integer"},
                        "stream_options": {"type": "object"},
                        "logprobs": {"type": "boolean"},
                        "top_logprobs": {"type": "integer"},
                        "presence_penalty": {"type": "number"},
                        "frequency_penalty": {"type": "number"},
                        "user": {"type": "string"},
                    },
                },
                "ChatCompletion": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"const": "chat.completion"},
                        "created": {"type": "integer"},
                        "model": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "object"}},
                        "usage": {"type": "object"},
                    },
                },
            },
        },
        "paths": {},
    }
    P = spec["paths"]
    P["/v1/chat/completions"] = {
        "post": {
            "summary": "Create a chat completion (OpenAI-compatible; SSE when stream=true)",
            "security": tenant,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref("ChatCompletionRequest")}},
            },
            "responses": {
                "200": {
                    "description": "completion (JSON) or text/event-stream of chat.completion.chunk",
                    "headers": rl_headers,
                    "content": {
                        "application/json": {"schema": ref("ChatCompletion")},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 429),
                "429": {
                    "description": "rate_limit_exceeded or insufficient_quota",
                    "headers": {
                        **rl_headers,
                        "retry-after": {"schema": {"type": "string"}},
                        "retry-after-ms": {"schema": {"type": "string"}},
                        "x-should-retry": {"schema": {"type": "string"}},
                    },
                    "content": {"application/json": {"schema": _err_schema()}},
                },
            },
        }
    }
    P["/v1/usage"] = {
        "get": {
            "summary": "The calling tenant's own usage",
            "security": tenant,
            "parameters": [
                {"name": n, "in": "query", "schema": {"type": "string"}} for n in ("since", "until")
            ],
            "responses": {"200": _resp("usage", ref("Usage")), **_errors(400, 401)},
        }
    }
    A = "/admin/v1"
    P[f"{A}/stats"] = {
        "get": {
            "summary": "Engine counters (served by the gateway itself; admin key)",
            "security": admin,
            "responses": {"200": _resp("stats", {"type": "object"}), **_errors(401, 403)},
        }
    }
    P[f"{A}/tenants"] = {
        "post": {
            "summary": "Create a tenant",
            "security": admin,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref("TenantCreate")}},
            },
            "responses": {"201": _resp("created", ref("Tenant")), **_errors(400, 401, 403, 409)},
        },
        "get": {
            "summary": "List tenants",
            "security": admin,
            "responses": {
                "200": _resp(
                    "tenants",
                    {
                        "type": "object",
                        "properties": {
                            "object": {"const": "list"},
                            "data": {"type": "array", "items": ref("Tenant")},
                        },
                    },
                ),
                **_errors(401, 403),
            },
        },
    }
    P[f"{A}/tenants/{{tenant_id}}"] = {
        "parameters": [tid],
        "get": {
            "summary": "Get a tenant",
            "security": admin,
            "responses": {"200": _resp("tenant", ref("Tenant")), **_errors(401, 403, 404)},
        },
        "patch": {
            "summary": "Update a tenant (name, disabled, limits, filters)",
            "security": admin,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref("TenantPatch")}},
            },
            "responses": {"200": _resp("tenant", ref("Tenant")), **_errors(400, 401, 403, 404, 409)},
        },
        "delete": {
            "summary": "Delete a tenant (its keys are revoked; usage is kept)",
            "security": admin,
            "responses": {"200": _resp("deleted", {"type": "object"}), **_errors(401, 403, 404)},
        },
    }
    P[f"{A}/tenants/{{tenant_id}}/keys"] = {
        "parameters": [tid],
        "post": {
            "summary": "Create an API key (the secret is returned once)",
            "security": admin,
            "requestBody": {"content": {"application/json": {"schema": ref("ApiKeyCreate")}}},
            "responses": {"201": _resp("created", ref("ApiKeyCreated")), **_errors(400, 401, 403, 404)},
        },
        "get": {
            "summary": "List a tenant's keys (prefixes only)",
            "security": admin,
            "responses": {
                "200": _resp(
                    "keys",
                    {
                        "type": "object",
                        "properties": {
                            "object": {"const": "list"},
                            "data": {"type": "array", "items": ref("ApiKey")},
                        },
                    },
                ),
                **_errors(401, 403, 404),
            },
        },
    }
    P[f"{A}/keys/{{key_id}}"] = {
        "parameters": [{"name": "key_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "delete": {
            "summary": "Revoke a key",
            "security": admin,
            "responses": {"200": _resp("revoked", ref("ApiKey")), **_errors(401, 403, 404)},
        },
        "get": {
            "summary": "Get a key (prefix only)",
            "security": admin,
            "responses": {"200": _resp("key", ref("ApiKey")), **_errors(401, 403, 404)},
        },
        "patch": {
            "summary": "Change a key's name, expiry or own limits (applies at once)",
            "security": admin,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref("ApiKeyCreate")}},
            },
            "responses": {"200": _resp("key", ref("ApiKey")), **_errors(400, 401, 403, 404)},
        },
    }
    P[f"{A}/tenants/{{tenant_id}}/limits"] = {
        "parameters": [tid],
        "get": {
            "summary": "Get limits",
            "security": admin,
            "responses": {"200": _resp("limits", ref("Limits")), **_errors(401, 403, 404)},
        },
        "put": {
            "summary": "Replace limits (missing/null field = unlimited; applies at once)",
            "security": admin,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref("Limits")}}},
            "responses": {"200": _resp("limits", ref("Limits")), **_errors(400, 401, 403, 404)},
        },
    }
    P[f"{A}/tenants/{{tenant_id}}/usage"] = {
        "parameters": [
            tid,
            *(
                {
                    "name": n,
                    "in": "query",
                    "schema": {"type": "string"},
                    "description": "UNIX seconds or ISO-8601 (UTC)",
                }
                for n in ("since", "until")
            ),
        ],
        "get": {
            "summary": "Usage totals and per-day sums",
            "security": admin,
            "responses": {"200": _resp("usage", ref("Usage")), **_errors(400, 401, 403, 404)},
        },
    }
    P[f"{A}/tenants/{{tenant_id}}/filters"] = {
        "parameters": [tid],
        "get": {
            "summary": "Get the tenant's filter config",
            "security": admin,
            "responses": {"200": _resp("filters", {}), **_errors(401, 403, 404)},
        },
        "put": {
            "summary": "Replace the tenant's filter config (validated)",
            "security": admin,
            "requestBody": {"required": True, "content": {"application/json": {"schema": {}}}},
            "responses": {"200": _resp("filters", {}), **_errors(400, 401, 403, 404)},
        },
    }
    return spec


def openapi_routes() -> list[Route]:
    """``GET /openapi.json`` (public)."""

    async def openapi(request: Request):
        return JSONResponse(openapi_spec())

    return [Route("/openapi.json", openapi, methods=["GET"])]
