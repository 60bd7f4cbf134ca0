"""What the store returns: a tenant and an API key, as plain records (times in UNIX seconds, UTC)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ratelimit.core import Limits


@dataclass
class TenantRecord:
    """A tenant: its limits, its filter config (a JSON value, see docs/filters.md), whether it is disabled,
    and ``deleted_at`` once deleted (its rows stay for the usage ledger)."""

    id: str
    name: str
    disabled: bool
    created_at: float
    limits: Limits
    filters: object
    deleted_at: float | None = None


@dataclass
class KeyRecord:
    """An API key: its visible ``prefix`` and the SHA-256 ``hash`` of the secret (never the secret), its
    expiry and revocation times, its own limits (None: only the tenant's apply)."""

    id: str
    tenant_id: str
    name: str | None
    prefix: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    limits: Limits | None = None
    hash: str = field(default="", repr=False)
