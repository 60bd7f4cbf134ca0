"""``GET /v1/inspect/{request_id}``: a request's inspection record, for the tenant that sent it (gateway
extension; the request asked with ``"inspect": true``).

The store is one per app (``inspect_store``: made on first use, on the app's state). Answers 200 with the
``InspectRecord`` JSON (``cache-control: no-store``), or 404 ``inspect_record_not_found`` when this tenant
has no such record: never asked, expired (``InspectStore.ttl_s``), pushed out by newer ones, or another
tenant's (the same answer: ids of other tenants are not revealed). Without tenancy every caller is one
tenant.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.errors import NotFound
from gateway.inspector.store import InspectStore
from gateway.state import Gateway


def inspect_store(request: Request) -> InspectStore:
    """The app's ``InspectStore`` (made on first use; the Trio loop is its only user)."""
    state = request.app.state
    store = getattr(state, "inspections", None)
    if store is None:
        store = state.inspections = InspectStore()
    return store


async def inspect_record(request: Request) -> Response:
    """GET /v1/inspect/{request_id}. Raises ``NotFound`` (404) when this tenant has no such record."""
    gw: Gateway = request.app.state.gateway
    principal = await gw.authenticate(request)
    tenant = principal.tenant_id if principal is not None else ""
    rid = request.path_params["request_id"]
    data = inspect_store(request).get(tenant, rid)
    if data is None:
        raise NotFound(
            f"No inspection record for request '{rid}': records are kept {inspect_store(request).ttl_s:g} s "
            'for the tenant that sent the request with "inspect": true.',
            param="request_id",
            code="inspect_record_not_found",
        )
    return Response(data, media_type="application/json", headers={"cache-control": "no-store"})


def inspect_routes() -> list[BaseRoute]:
    """The inspection route, to mount in the app's route table."""
    return [Route("/v1/inspect/{request_id}", inspect_record, methods=["GET"])]
