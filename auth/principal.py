"""Who is calling: the principal a tenant key authenticates as (tenant, key, limits, filter config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ratelimit.core import Limits


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant key that passed authentication.

    Attributes:
        tenant_id, tenant_name: the tenant.
        key_id: public id of the key (``key_...``); key_prefix: its visible first characters (``sk-gw-AbCd``).
        limits: the tenant's limits; key_limits: the key's own limits (or None).
        filters: the tenant's opaque filter config (JSON value; interpreted by gateway.filters).
    """

    tenant_id: str
    tenant_name: str
    key_id: str
    key_prefix: str
    limits: Limits
    key_limits: Limits | None = None
    filters: Any = field(default_factory=dict)

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "limits": self.limits.to_dict(),
            "key_limits": self.key_limits.to_dict() if self.key_limits else None,
            "filters": self.filters,
        }
