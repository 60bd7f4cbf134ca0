"""Request bodies and response objects of the admin API (``/admin/v1``) and ``GET /v1/usage``, as msgspec Structs.

The bodies are decoded strictly (unknown fields, wrong types, out-of-range values and missing required fields are
a 400 naming the field), and the OpenAPI document (``gateway.openapi``) is generated from these same types.
Limits come in three shapes:

* :class:`LimitsPut` (``PUT .../limits``): the whole object; ``rpm``, ``tpm``, ``max_concurrent`` and
  ``daily_tokens`` are required (``null`` = unlimited), ``window_s`` is optional (absent: the current one stays).
* :class:`LimitsPatch` (``PATCH .../limits``, and the ``limits`` member of tenant and key bodies): any subset.
  Sent to ``PATCH .../limits`` an absent field keeps its value; as a ``limits`` member the object replaces the
  limits and an absent field is unlimited (``window_s`` absent: the current window, 60 s for a new tenant/key).
* :class:`LimitsObject`: what the API answers.

Models: ``models`` (a tenant's, a key's) lists the model names it may use, ``null`` for every model (a key's
list narrows its tenant's); ``model_limits`` maps a served model name to the limits (a :class:`LimitsPatch`
object, absent fields unlimited) that requests to that model take besides the tenant's. Names are not checked
against the models served now (a model may be added later); a name is 1-256 characters without leading or
trailing white space.

Units: tokens, requests, seconds; times are UNIX seconds (UTC).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

Count = Annotated[int, Meta(ge=0, le=2**53 - 1)]  # JSON-exact and within PostgreSQL/Redis int64
Window = Annotated[float, Meta(ge=0.01, le=86400, description="refill window of rpm/tpm, seconds")]
Name = Annotated[str, Meta(min_length=1, max_length=128)]
KeyName = Annotated[str, Meta(max_length=128)]
JSONValue = Annotated[object, Meta(extra_json_schema={"description": "any JSON value"})]
Filters = Annotated[object, Meta(extra_json_schema={"description": "filter config (docs/filters.md)"})]
ModelName = Annotated[
    str, Meta(min_length=1, max_length=256, pattern=r"^\S(.*\S)?$", description="a model name")
]
ModelList = Annotated[
    list[ModelName],
    Meta(max_length=1024, description="the model names (served names or aliases) allowed; null: every model"),
]
Expiry = Annotated[
    float | str | None,
    Meta(description="UNIX seconds or an ISO-8601 time, in the future; null: never expires"),
]


class LimitsPut(Struct, forbid_unknown_fields=True, kw_only=True):
    """``PUT /admin/v1/tenants/{id}/limits``: every limit, ``null`` for unlimited."""

    rpm: Annotated[Count | None, Meta(description="requests per window (per minute)")]
    tpm: Annotated[Count | None, Meta(description="tokens per window: prompt + max_tokens reserved")]
    max_concurrent: Annotated[Count | None, Meta(description="requests in flight at once")]
    daily_tokens: Annotated[Count | None, Meta(description="tokens (prompt + completion) per UTC day")]
    window_s: Window | UnsetType = UNSET


class LimitsPatch(Struct, forbid_unknown_fields=True, kw_only=True):
    """Some limits: ``PATCH .../limits`` (absent: unchanged) or a ``limits`` member (absent: unlimited)."""

    rpm: Count | None | UnsetType = UNSET
    tpm: Count | None | UnsetType = UNSET
    max_concurrent: Count | None | UnsetType = UNSET
    daily_tokens: Count | None | UnsetType = UNSET
    window_s: Window | UnsetType = UNSET


class LimitsObject(Struct, kw_only=True):
    """A scope's limits (``null``: unlimited)."""

    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    daily_tokens: int | None
    window_s: float


ModelLimits = Annotated[
    dict[ModelName, LimitsPatch],
    Meta(description="served model name -> limits taken besides the tenant's for requests to that model"),
]


class TenantCreate(Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /admin/v1/tenants``."""

    name: Name
    limits: LimitsPatch | None = None
    filters: Filters = {}
    disabled: bool = False
    models: ModelList | None = None
    model_limits: ModelLimits = {}


class TenantPatch(Struct, forbid_unknown_fields=True, kw_only=True):
    """``PATCH /admin/v1/tenants/{id}``: the members given change."""

    name: Name | UnsetType = UNSET
    disabled: bool | UnsetType = UNSET
    limits: LimitsPatch | None | UnsetType = UNSET
    filters: Filters | UnsetType = UNSET
    models: ModelList | None | UnsetType = UNSET
    model_limits: (
        Annotated[ModelLimits | None, Meta(description="replaces the map; null: {}")] | UnsetType
    ) = UNSET


class KeyCreate(Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /admin/v1/tenants/{id}/keys`` (an empty body is ``{}``)."""

    name: KeyName | None = None
    expires_at: Expiry = None
    limits: Annotated[LimitsPatch | None, Meta(description="the key's own limits; null: none")] = None
    models: Annotated[
        ModelList | None, Meta(description="narrows the tenant's models; null: the tenant's")
    ] = None


class KeyPatch(Struct, forbid_unknown_fields=True, kw_only=True):
    """``PATCH /admin/v1/keys/{key_id}``: the members given change."""

    name: KeyName | None | UnsetType = UNSET
    expires_at: Expiry | UnsetType = UNSET
    limits: LimitsPatch | None | UnsetType = UNSET
    models: ModelList | None | UnsetType = UNSET


class Tenant(Struct, kw_only=True):
    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    disabled: bool
    created_at: float
    limits: LimitsObject
    filters: Filters
    models: list[str] | None
    model_limits: dict[str, LimitsObject]


class TenantList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Tenant]


class TenantDeleted(Struct, kw_only=True):
    id: str
    object: Literal["tenant.deleted"] = "tenant.deleted"
    deleted: bool = True


class ApiKey(Struct, kw_only=True):
    """A key as listed: its visible ``prefix``, never the secret."""

    id: str
    object: Literal["api_key"] = "api_key"
    tenant_id: str
    name: str | None
    prefix: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    limits: LimitsObject | None
    models: list[str] | None


class ApiKeyCreated(ApiKey, kw_only=True):
    key: Annotated[str, Meta(description="the secret key, shown only in this response")]


class ApiKeyRevoked(ApiKey, kw_only=True):
    revoked: bool = True


class KeyList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ApiKey]


class UsageTotals(Struct, kw_only=True):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageDay(UsageTotals, kw_only=True):
    day: Annotated[str, Meta(extra_json_schema={"format": "date"})]


class Usage(Struct, kw_only=True):
    """Ledger sums of rows with ``since <= ts < until`` (UNIX seconds; null: unbounded)."""

    object: Literal["usage"] = "usage"
    tenant_id: str
    since: float | None
    until: float | None
    totals: UsageTotals
    days: list[UsageDay]


GroupBy = Literal["tenant", "key", "model", "day"]


class SpendGroup(UsageTotals, kw_only=True):
    """The sums of one group: ``group`` is the tenant id, key id, model name or UTC day (``YYYY-MM-DD``) of
    its rows (null: rows without one, e.g. a request refused before a key was known)."""

    group: str | None


class Spend(Struct, kw_only=True):
    """``GET /admin/v1/spend``: ledger sums of rows with ``since <= ts < until`` (UNIX seconds; null:
    unbounded), filtered by the tenant, key and model given (null: all), one entry per ``group_by`` value in
    ``data``: most tokens first (``day``: in date order). Tokens, not money."""

    object: Literal["spend"] = "spend"
    since: float | None
    until: float | None
    tenant_id: str | None
    key_id: str | None
    model: str | None
    group_by: GroupBy
    totals: UsageTotals
    data: list[SpendGroup]
