"""Probes and engine stats: GET /health, /healthz, /readyz (public) and GET /admin/v1/stats (admin key).

/health is liveness as in vLLM (200, empty body, while the process runs, during a drain too); /healthz
is the same with ``{"status": "ok"}``; /readyz is readiness: 200 while a backend is ready and the gateway
is not draining, else 503 with an OpenAI error body whose code says why.
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
)


async def health(request: Request) -> Response:
    """GET /health (HEAD too): liveness, 200 with an empty body while the process runs, as vLLM's /health.
    Public (no key) and answered during a drain; readiness (a backend up, not draining) is /readyz."""
    return Response(status_code=200)


async def healthz(request: Request) -> Response:
    """GET /healthz: 200 ``{"status": "ok"}`` while the process runs."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """GET /readyz: 200 ``{"status": "ready"}``, or 503 with a code: ``server_shutting_down`` (draining),
    ``model_unavailable`` (every backend failed its restarts; with ``retry-after``, as a request gets it),
    ``backend_unavailable`` (starting or restarting)."""
    gw: Gateway = request.app.state.gateway
    if gw.pool.is_ready():
        return JSONResponse({"status": "ready"})
    err: APIError | None = None
    if gw.pool.draining:
        err = ServiceUnavailable("draining", code="server_shutting_down")
    else:
        err = gw.pool.unavailable_error() or ServiceUnavailable(
            "no backend ready", code="backend_unavailable"
        )
    return JSONResponse(err.body(), status_code=503, headers=err.headers)


async def admin_stats(request: Request) -> Response:
    """GET /admin/v1/stats: the backends' ``Stats`` summed (counts; ``STATS_FIELDS``), device, attention
    backend, per-backend supervisor state (``backends``) and ``draining``. Raises 401/403 without the
    admin key."""
    gw: Gateway = request.app.state.gateway
    await gw.check_admin(request)
    total: dict[str, Any] = {f: 0 for f in STATS_FIELDS}
    device = attention = None
    backends = []
    for sup in gw.pool.supervisors:
        info = sup.info()
        c = sup.client
        if c is not None and c.alive:
            try:
                st = await c.get_stats()
                for f in STATS_FIELDS:
                    total[f] += getattr(st, f)
                device = device or st.device
                attention = attention or st.attention_backend
                info["stats"] = msgspec.to_builtins(st)
            except APIError as exc:
                info["error"] = exc.message
        backends.append(info)
    if device is None and gw.pool.card is not None:
        device, attention = gw.pool.card.device, gw.pool.card.attention_backend
    total.update(device=device, attention_backend=attention, backends=backends, draining=gw.pool.draining)
    return JSONResponse(total)
