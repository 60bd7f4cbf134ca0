"""Probes and engine stats: GET /health, /healthz, /readyz (public) and GET /admin/v1/stats (admin key).

/health is liveness as in vLLM (200, empty body, while the process runs, during a drain too); /healthz
is the same with ``{"status": "ok"}``; /readyz is readiness: 200 while every native model of the catalog
has a ready backend and the gateway is not draining, else 503 with an OpenAI error body whose code says why.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import APIError, ServiceUnavailable
from gateway.state import Gateway

STATS_FIELDS = (
    "running",
    "waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_blocks_cached",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "preemptions",
    "aborts",
    "requests_finished",
    "prompt_tokens",
    "generation_tokens",
    "steps",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


async def health(request: Request) -> Response:
    """GET /health (HEAD too): liveness, 200 with an empty body while the process runs, as vLLM's /health.
    Public (no key) and answered during a drain; readiness (a backend up, not draining) is /readyz."""
    return Response(status_code=200)


async def healthz(request: Request) -> Response:
    """GET /healthz: 200 ``{"status": "ok"}`` while the process runs."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """GET /readyz: 200 ``{"status": "ready"}`` when every native model has a ready backend, or 503 with a
    code: ``server_shutting_down`` (draining), ``model_unavailable`` (every backend of a model failed its
    restarts; with ``retry-after``, as a request gets it), ``backend_unavailable`` (a model's backends are
    starting or restarting); the message names the first model that is not ready."""
    gw: Gateway = request.app.state.gateway
    catalog = gw.catalog
    if not catalog.draining and catalog.is_ready():
        return JSONResponse({"status": "ready"})
    err: APIError | None = None
    if catalog.draining:
        err = ServiceUnavailable("draining", code="server_shutting_down")
    else:
        waiting = next(m for m in catalog if not m.is_ready())
        unavailable = waiting.pool.unavailable_error() if waiting.pool is not None else None
        if unavailable is not None:  # the pool's message does not know its model's name: prefix it
            err = ServiceUnavailable(f"model '{waiting.name}': {unavailable.message}", code=unavailable.code)
            err.headers.update(unavailable.headers)
        else:
            err = ServiceUnavailable(
                f"no backend of the model '{waiting.name}' ready", code="backend_unavailable"
            )
    return JSONResponse(err.body(), status_code=503, headers=err.headers)


async def admin_stats(request: Request) -> Response:
    """GET /admin/v1/stats: the backends' ``Stats`` summed over every model (counts; ``STATS_FIELDS``; the
    speculative decoding's ``spec_accepted_per_pos`` summed position by position), device, attention
    backend, per-backend supervisor state (``backends``, each with its ``model``: the served name) and
    ``draining``. Raises 401/403 without the admin key."""
    gw: Gateway = request.app.state.gateway
    await gw.check_admin(request)
    total: dict[str, Any] = {f: 0 for f in STATS_FIELDS}
    per_pos: list[int] = []
    device = attention = None
    backends = []
    served = [(m.name, sup) for m in gw.catalog if m.pool is not None for sup in m.pool.supervisors]
    for model, sup in served:
        info = sup.info() | {"model": model}
        c = sup.client
        if c is not None and c.alive:
            try:
                st = await c.get_stats()
                for f in STATS_FIELDS:
                    total[f] += getattr(st, f)
                per_pos = _add_positions(per_pos, st.spec_accepted_per_pos)
                device = device or st.device
                attention = attention or st.attention_backend
                info["stats"] = msgspec.to_builtins(st)
            except APIError as exc:
                info["error"] = exc.message
        backends.append(info)
    card = gw.catalog.default.card_or_none
    if device is None and card is not None:
        device, attention = card.device, card.attention_backend
    total.update(
        spec_accepted_per_pos=per_pos,
        device=device,
        attention_backend=attention,
        backends=backends,
        draining=gw.catalog.draining,
    )
    return JSONResponse(total)


def _add_positions(a: list[int], b: list[int]) -> list[int]:
    """Two per-position counts summed position by position (the shorter one padded with zeros)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
