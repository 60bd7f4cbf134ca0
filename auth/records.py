"""What the store returns: a tenant and an API key, as plain records (times in UNIX seconds, UTC)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ratelimit.core import Limits


@dataclass
class TenantRecord:
    """A tenant: its limits, its filter config (a JSON value, see docs/filters.md), whether it is disabled,
    and ``deleted_at`` once deleted (its rows stay for the usage ledger).

    ``models``: the model names it may use (None: every model); ``model_limits``: served model name -> the
    limits its requests to that model take besides ``limits`` (a model without an entry: none of its own).
    """

    id: str
    name: str
    disabled: bool
    created_at: float
    limits: Limits
    filters: object
    deleted_at: float | None = None
    models: list[str] | None = None
    model_limits: dict[str, Limits] = field(default_factory=dict)


@dataclass
class KeyRecord:
    """An API key: its visible ``prefix`` and the SHA-256 ``hash`` of the secret (never the secret), its
    expiry and revocation times, its own limits (None: only the tenant's apply), the models it may use (None: the
    tenant's; else only those of them in both lists)."""

    id: str
    tenant_id: str
    name: str | None
    prefix: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    limits: Limits | None = None
    hash: str = field(default="", repr=False)
    models: list[str] | None = None
