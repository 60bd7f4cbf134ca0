"""Who is calling: the principal a tenant key authenticates as (tenant, key, limits, filter config)."""

from __future__ import annotations

from collections.abc import Mapping
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
        models: the model names (served names or aliases) the tenant may use; None: every model. With a key
            restricted to models of its own: the tenant's names that the key's list also holds.
        model_limits: served model name -> the tenant's limits for its requests to that model, taken besides
            ``limits`` (``ratelimit.admission``); a model without an entry has none of its own.
    """

    tenant_id: str
    tenant_name: str
    key_id: str
    key_prefix: str
    limits: Limits
    key_limits: Limits | None = None
    filters: Any = field(default_factory=dict)
    models: tuple[str, ...] | None = None
    model_limits: Mapping[str, Limits] = field(default_factory=dict)

    def allows_model(self, *names: str) -> bool:
        """True when the tenant may use a model known by any of ``names`` (its served name and aliases)."""
        return self.models is None or any(n in self.models for n in names)

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "limits": self.limits.to_dict(),
            "key_limits": self.key_limits.to_dict() if self.key_limits else None,
            "filters": self.filters,
            "models": list(self.models) if self.models is not None else None,
            "model_limits": {m: lim.to_dict() for m, lim in self.model_limits.items()},
        }
