"""Admin API handlers (relative to the mount point ``/admin/v1``; admin key) and ``GET /v1/usage`` (tenant key).

::

    POST   /tenants                    TenantCreate  -> 201 Tenant (409 name taken)
    GET    /tenants                                  -> TenantList
    GET    /tenants/{id}   PATCH TenantPatch   DELETE -> Tenant / TenantDeleted (keys revoked, usage kept)
    POST   /tenants/{id}/keys          KeyCreate     -> 201 ApiKeyCreated (the secret, once; no-store)
    GET    /tenants/{id}/keys                        -> KeyList (prefixes only)
    GET    /keys/{key_id}  PATCH KeyPatch      DELETE -> ApiKey / ApiKeyRevoked
    GET    /tenants/{id}/limits  PUT LimitsPut  PATCH LimitsPatch -> LimitsObject (applies at once)
    GET    /tenants/{id}/usage?since=&until=         -> Usage
    GET    /tenants/{id}/filters  PUT any JSON (validated by gateway.filters.parse_config) -> the config
    DELETE /tenants/{id}/leases                      -> LeasesCleared (its concurrency slots freed, every gateway)
    GET    /spend?since=&until=&tenant_id=&key_id=&model=&group_by=tenant|key|model|day -> Spend (tokens)

``{id}`` is a tenant id (``tn_...``) or its name. Every change invalidates the key cache, so it applies to the
next request. The auth middleware checked the admin key already; each handler makes sure it did
(:meth:`Tenants.require_admin`), so the routes stay closed in an app without it. Errors (OpenAI's body): 400
(bad body or query), 401/403 (admin key), 404 (tenant or key), 409 (name taken), 413 (body too large), 503
(the shared rate limiter, Redis, or the tenancy store did not answer; ``retry-after``). Every string a body
gives is checked as text (``gateway.admin.body.checked_text``: no lone surrogate, no NUL in a name; 400 naming
the field); a stored value that UTF-8 cannot encode is answered escaped (``body.encoded``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from auth.errors import StoreUnavailable
from auth.records import KeyRecord, TenantRecord
from gateway.admin.body import encoded, merged, model_limits, model_list, read_json, read_struct, replaced
from gateway.admin.schemas import (
    ApiKey,
    ApiKeyCreated,
    ApiKeyRevoked,
    KeyCreate,
    KeyList,
    KeyPatch,
    LimitsObject,
    LimitsPatch,
    LimitsPut,
    Tenant,
    TenantCreate,
    TenantDeleted,
    TenantList,
    TenantPatch,
    Usage,
)
from gateway.admin.spend import spend
from gateway.admin.times import expiry, parse_time
from gateway.error_map import api_error
from gateway.errors import APIError, InvalidRequest, NotFound
from gateway.filters import parse_config
from gateway.observability.record import get_record
from gateway.tenants import Tenants
from ratelimit.core import Limits

Handler = Callable[[Request], Awaitable[Response]]


class LeasesCleared(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``DELETE /admin/v1/tenants/{id}/leases``: the concurrency slots freed, in every gateway sharing the
    limiter; the requests that held them run on uncounted (``model_leases_cleared``: only when not 0)."""

    tenant_id: str
    cleared: Annotated[int, msgspec.Meta(ge=0, description="slots the tenant scope held")]
    key_leases_cleared: Annotated[int, msgspec.Meta(ge=0, description="slots its keys' own limits held")]
    model_leases_cleared: Annotated[int, msgspec.Meta(ge=0, description="slots its model_limits held")] = 0


class Conflict(APIError):
    """409: a tenant name already taken."""

    status = 409
    type = "invalid_request_error"


def reply(obj: msgspec.Struct, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encoded(obj), status, headers, media_type="application/json")


def error_reply(e: APIError) -> Response:
    return Response(encoded(e.body()), e.status, e.headers, media_type="application/json")


def limits_object(lim: Limits) -> LimitsObject:
    return LimitsObject(
        rpm=lim.rpm,
        tpm=lim.tpm,
        max_concurrent=lim.max_concurrent,
        daily_tokens=lim.daily_tokens,
        window_s=lim.window_s,
    )


def tenant_object(t: TenantRecord) -> Tenant:
    return Tenant(
        id=t.id,
        name=t.name,
        disabled=t.disabled,
        created_at=t.created_at,
        limits=limits_object(t.limits),
        filters=t.filters,
        models=t.models,
        model_limits={m: limits_object(lim) for m, lim in t.model_limits.items()},
    )


def key_fields(k: KeyRecord) -> dict[str, object]:
    return {
        "id": k.id,
        "tenant_id": k.tenant_id,
        "name": k.name,
        "prefix": k.prefix,
        "created_at": k.created_at,
        "expires_at": k.expires_at,
        "revoked_at": k.revoked_at,
        "limits": limits_object(k.limits) if k.limits else None,
        "models": k.models,
    }


def checked_filters(config: object) -> object:
    """``config`` if it is a JSON object ``gateway.filters.parse_config`` accepts (``{}``: no filtering).

    Raises:
        InvalidRequest: 400 ``invalid_type`` for anything but an object (``null`` included: clearing the
            filters takes an explicit ``{}``), ``invalid_value`` for a config that does not validate.
    """
    if not isinstance(config, dict):
        raise InvalidRequest(
            "The filter config must be a JSON object ({} for no filtering).",
            param="filters",
            code="invalid_type",
        )
    try:
        parse_config(config)
    except ValueError as e:
        raise InvalidRequest(f"invalid filters config: {e}", param="filters", code="invalid_value") from None
    return config


def no_such_key() -> NotFound:
    return NotFound("No such API key.", param="key_id", code="key_not_found")


class AdminAPI:
    """The handlers, bound to one process's :class:`~gateway.tenants.Tenants`."""

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants
        self.store = tenants.store

    def guarded(self, fn: Handler) -> Handler:
        """``fn`` behind the admin check, its APIErrors answered as OpenAI error bodies."""

        async def endpoint(request: Request) -> Response:
            try:
                try:
                    await self.tenants.require_admin(request.scope)
                    return await fn(request)
                except StoreUnavailable as e:
                    raise api_error(e) from None
            except APIError as e:
                get_record(request).set_error(e.type, e.code)
                return error_reply(e)

        endpoint.__name__, endpoint.__doc__ = fn.__name__, fn.__doc__
        return endpoint

    async def tenant_or_404(self, request: Request) -> TenantRecord:
        t = await self.store.get_tenant(request.path_params["tenant_id"])
        if t is None:
            raise NotFound("No such tenant.", param="tenant_id", code="tenant_not_found")
        return t

    async def changed_tenant(self, tid: str, **kw: object) -> TenantRecord:
        try:
            t = await self.store.update_tenant(tid, **kw)
        except ValueError as e:
            raise Conflict(str(e), param="name", code="tenant_exists") from None
        self.tenants.invalidate()
        return t

    async def create_tenant(self, request: Request) -> Response:
        body = await read_struct(request, TenantCreate)
        if not body.name.strip():
            raise InvalidRequest("name must not be blank", param="name", code="invalid_value")
        limits = replaced(body.limits) if body.limits is not None else Limits()
        filters = checked_filters(body.filters)
        by_model = model_limits(body.model_limits, {})
        try:
            t = await self.store.create_tenant(
                body.name.strip(), limits, filters, models=model_list(body.models), model_limits=by_model
            )
        except ValueError as e:
            raise Conflict(str(e), param="name", code="tenant_exists") from None
        if body.disabled:
            t = await self.changed_tenant(t.id, disabled=True)
        self.tenants.invalidate()
        return reply(tenant_object(t), 201)

    async def list_tenants(self, request: Request) -> Response:
        ts = await self.store.list_tenants()
        return reply(TenantList(data=[tenant_object(t) for t in ts]))

    async def get_tenant(self, request: Request) -> Response:
        return reply(tenant_object(await self.tenant_or_404(request)))

    async def patch_tenant(self, request: Request) -> Response:
        t = await self.tenant_or_404(request)
        body = await read_struct(request, TenantPatch)
        kw: dict[str, object] = {}
        if body.name is not msgspec.UNSET:
            if not body.name.strip():
                raise InvalidRequest("name must not be blank", param="name", code="invalid_value")
            kw["name"] = body.name.strip()
        if body.disabled is not msgspec.UNSET:
            kw["disabled"] = body.disabled
        if body.limits is not msgspec.UNSET:
            kw["limits"] = replaced(body.limits, t.limits.window_s) if body.limits is not None else Limits()
        if body.filters is not msgspec.UNSET:
            kw["filters"] = checked_filters(body.filters)
        if body.models is not msgspec.UNSET:
            kw["models"] = model_list(body.models)
        if body.model_limits is not msgspec.UNSET:
            kw["model_limits"] = model_limits(body.model_limits, t.model_limits)
        return reply(tenant_object(await self.changed_tenant(t.id, **kw)))

    async def delete_tenant(self, request: Request) -> Response:
        t = await self.tenant_or_404(request)
        await self.store.delete_tenant(t.id)
        self.tenants.invalidate()
        return reply(TenantDeleted(id=t.id))

    async def create_key(self, request: Request) -> Response:
        t = await self.tenant_or_404(request)
        body = await read_struct(request, KeyCreate, required=False)
        limits = replaced(body.limits) if body.limits is not None else None
        key, rec = await self.store.create_key(
            t.id,
            name=body.name,
            expires_at=expiry(body.expires_at),
            limits=limits,
            models=model_list(body.models),
        )
        return reply(ApiKeyCreated(**key_fields(rec), key=key), 201, {"cache-control": "no-store"})

    async def list_keys(self, request: Request) -> Response:
        t = await self.tenant_or_404(request)
        ks = await self.store.list_keys(t.id)
        return reply(KeyList(data=[ApiKey(**key_fields(k)) for k in ks]))

    async def revoke_key(self, request: Request) -> Response:
        rec = await self.store.revoke_key(request.path_params["key_id"])
        if rec is None:
            raise no_such_key()
        self.tenants.invalidate()
        return reply(ApiKeyRevoked(**key_fields(rec)))

    async def get_key(self, request: Request) -> Response:
        rec = await self.store.get_key(request.path_params["key_id"])
        if rec is None:
            raise no_such_key()
        return reply(ApiKey(**key_fields(rec)))

    async def patch_key(self, request: Request) -> Response:
        kid = request.path_params["key_id"]
        if await self.store.get_key(kid) is None:
            raise no_such_key()
        body = await read_struct(request, KeyPatch)
        kw: dict[str, object] = {}
        if body.name is not msgspec.UNSET:
            kw["name"] = body.name
        if body.expires_at is not msgspec.UNSET:
            kw["expires_at"] = expiry(body.expires_at)
        if body.limits is not msgspec.UNSET:
            kw["limits"] = replaced(body.limits) if body.limits is not None else None
        if body.models is not msgspec.UNSET:
            kw["models"] = model_list(body.models)
        rec = await self.store.update_key(kid, **kw)
        self.tenants.invalidate()
        return reply(ApiKey(**key_fields(rec)))

    async def get_limits(self, request: Request) -> Response:
        return reply(limits_object((await self.tenant_or_404(request)).limits))

    async def put_limits(self, request: Request) -> Response:
        t = await self.tenant_or_404(request)
        body = await read_struct(request, LimitsPut)
        return reply(limits_object((await self.changed_tenant(t.id, limits=merged(body, t.limits))).limits))

    async def patch_limits(self, request: Request) -> Response:
        t = await self.tenant_or_404(request)
        body = await read_struct(request, LimitsPatch)
        return reply(limits_object((await self.changed_tenant(t.id, limits=merged(body, t.limits))).limits))

    async def get_usage(self, request: Request) -> Response:
        t = await self.tenant_or_404(request)
        return reply(await usage(self.tenants, t.id, request))

    async def get_filters(self, request: Request) -> Response:
        return reply_json((await self.tenant_or_404(request)).filters)

    async def put_filters(self, request: Request) -> Response:
        t = await self.tenant_or_404(request)
        config = checked_filters(await read_json(request, required=True, within="filters"))
        return reply_json((await self.changed_tenant(t.id, filters=config)).filters)

    async def clear_leases(self, request: Request) -> Response:
        """Free the tenant's concurrency slots (a gateway that died holding them: they would lapse within the
        lease time anyway)."""
        t = await self.tenant_or_404(request)
        n, keys, models = await self.tenants.clear_leases(t.id, list(t.model_limits))
        return reply(
            LeasesCleared(tenant_id=t.id, cleared=n, key_leases_cleared=keys, model_leases_cleared=models)
        )

    async def spend(self, request: Request) -> Response:
        return reply(await spend(self.tenants, request.query_params))

    def routes(self) -> list[BaseRoute]:
        """The admin routes; mount them under ``/admin/v1``."""
        table: list[tuple[str, str, Handler]] = [
            ("POST", "/tenants", self.create_tenant),
            ("GET", "/tenants", self.list_tenants),
            ("GET", "/tenants/{tenant_id}", self.get_tenant),
            ("PATCH", "/tenants/{tenant_id}", self.patch_tenant),
            ("DELETE", "/tenants/{tenant_id}", self.delete_tenant),
            ("POST", "/tenants/{tenant_id}/keys", self.create_key),
            ("GET", "/tenants/{tenant_id}/keys", self.list_keys),
            ("DELETE", "/keys/{key_id}", self.revoke_key),
            ("GET", "/keys/{key_id}", self.get_key),
            ("PATCH", "/keys/{key_id}", self.patch_key),
            ("GET", "/tenants/{tenant_id}/limits", self.get_limits),
            ("PUT", "/tenants/{tenant_id}/limits", self.put_limits),
            ("PATCH", "/tenants/{tenant_id}/limits", self.patch_limits),
            ("GET", "/tenants/{tenant_id}/usage", self.get_usage),
            ("GET", "/tenants/{tenant_id}/filters", self.get_filters),
            ("PUT", "/tenants/{tenant_id}/filters", self.put_filters),
            ("DELETE", "/tenants/{tenant_id}/leases", self.clear_leases),
            ("GET", "/spend", self.spend),
        ]
        return [Route(path, self.guarded(fn), methods=[method]) for method, path, fn in table]


def reply_json(value: object) -> Response:
    return Response(encoded(value), media_type="application/json")


async def usage(tenants: Tenants, tenant_id: str, request: Request) -> Usage:
    """A tenant's usage for the ``since``/``until`` query (the queued ledger rows written first)."""
    since = parse_time(request.query_params.get("since"), "since")
    until = parse_time(request.query_params.get("until"), "until")
    await tenants.ledger.flush()
    return msgspec.convert(await tenants.store.usage_summary(tenant_id, since, until), Usage)


def admin_routes(tenants: Tenants) -> list[BaseRoute]:
    """Starlette routes of the admin API bound to ``tenants`` (mount under ``/admin/v1``)."""
    return AdminAPI(tenants).routes()


def usage_routes(tenants: Tenants) -> list[BaseRoute]:
    """``GET /v1/usage?since=&until=``: the calling tenant's own usage (tenant key; never another tenant's)."""

    async def my_usage(request: Request) -> Response:
        try:
            try:
                principal = await tenants.principal(request.scope)
                return reply(await usage(tenants, principal.tenant_id, request))
            except StoreUnavailable as e:
                raise api_error(e) from None
        except APIError as e:
            get_record(request).set_error(e.type, e.code)
            return error_reply(e)

    return [Route("/v1/usage", my_usage, methods=["GET"])]
