"""``GET /admin/v1/spend``: ledger sums over a time range, per tenant, key, model or UTC day (tokens, not money;
the shape of LiteLLM's ``/spend`` reports, counted in tokens).

::

    GET /admin/v1/spend?since=&until=&tenant_id=&key_id=&model=&group_by=tenant|key|model|day -> Spend

``since``/``until``: UNIX seconds or ISO-8601 (``since <= ts < until``; absent: unbounded); ``tenant_id`` an id
or a name (deleted tenants included), ``key_id`` and ``model`` exact; ``group_by`` defaults to ``tenant``.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from gateway.admin.schemas import Spend
from gateway.admin.times import parse_time
from gateway.errors import InvalidRequest, NotFound
from gateway.tenants import Tenants

GROUPS = ("tenant", "key", "model", "day")


async def spend(tenants: Tenants, query: Mapping[str, str]) -> Spend:
    """The report for ``query`` (the queued ledger rows written first).

    Raises:
        InvalidRequest: 400 for a bad ``since``/``until`` (or ``until`` before ``since``) or ``group_by``
            (param names it).
        NotFound: 404 ``tenant_not_found`` for a ``tenant_id`` that never existed.
        auth.errors.StoreUnavailable: the store did not answer (503 through the admin API's guard).
    """
    since, until = parse_time(query.get("since"), "since"), parse_time(query.get("until"), "until")
    if since is not None and until is not None and until < since:
        raise InvalidRequest("until must not be before since", param="until", code="invalid_value")
    group_by = query.get("group_by") or "tenant"
    if group_by not in GROUPS:
        raise InvalidRequest(
            f"group_by must be one of {', '.join(GROUPS)}", param="group_by", code="invalid_value"
        )
    tenant_id = query.get("tenant_id") or None
    if tenant_id is not None:
        t = await tenants.store.get_tenant(tenant_id, include_deleted=True)
        if t is None:
            raise NotFound("No such tenant.", param="tenant_id", code="tenant_not_found")
        tenant_id = t.id
    key_id, model = query.get("key_id") or None, query.get("model") or None
    await tenants.ledger.flush()
    totals, groups = await tenants.store.spend(
        since=since, until=until, tenant_id=tenant_id, key_id=key_id, model=model, group_by=group_by
    )
    fields = {"since": since, "until": until, "tenant_id": tenant_id, "key_id": key_id, "model": model}
    return msgspec.convert({**fields, "group_by": group_by, "totals": totals, "data": groups}, Spend)
