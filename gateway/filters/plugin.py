"""Adapter the gateway app plugs in as ``Gateway(filters=TenantFilters())``.

It takes the authenticated principal (``auth.principal.Principal``: ``tenant_id`` and the tenant's
stored ``filters`` JSON) and finds the tenant's cached :class:`FilterPipeline` with
:func:`pipeline_for`, so config changes made through ``PUT /admin/v1/tenants/{id}/filters`` apply
to the next request. Without tenancy (principal None) no filtering happens, unless a default
config is given.
"""

from __future__ import annotations

from typing import Any

from auth.principal import Principal

from .matching import DEFAULT_BUDGET
from .pipeline import NO_FILTERS, FilterPipeline, OutputFilter, pipeline_for


def _tenant_id(principal: Principal | None) -> str | None:
    return principal.tenant_id if principal is not None else None


class TenantFilters:
    """Per-tenant filtering for the gateway.

    Args:
        default: filter config JSON for requests with no principal (tenancy off); default none.
        budget: seconds of matching each stage of one request may use (``http.filter_budget``); beyond it
            the request fails with 400 ``content_filter_timeout``.
    """

    def __init__(self, default: object = None, *, budget: float = DEFAULT_BUDGET) -> None:
        self.default = default
        self.budget = budget

    def pipeline(self, principal: Principal | None) -> FilterPipeline:
        """The principal's tenant pipeline (``NO_FILTERS`` when it has no config).

        Raises:
            ValueError: a stored config that no longer validates (the app should render it as 500).
        """
        cfg = principal.filters if principal is not None else self.default
        return pipeline_for(cfg) if cfg else NO_FILTERS

    async def check_prompt(
        self, principal: Principal | None, messages: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Prompt-stage hooks; returns the (maybe redacted) messages.

        Raises:
            gateway.errors.ContentFiltered: 400 ``content_filter`` (param ``messages``).
        """
        p = self.pipeline(principal)
        if not p.enabled:
            return messages
        return await p.check_prompt(_tenant_id(principal), messages, budget=self.budget)

    def output_filter(self, principal: Principal | None) -> OutputFilter | None:
        """A fresh OutputFilter for one choice, or None when the tenant has no output-stage hook."""
        p = self.pipeline(principal)
        if not p.filters_output:
            return None
        return p.output_filter(_tenant_id(principal), budget=self.budget)
