"""Admin API of the inference backends (relative to the mount point ``/admin/v1``; admin key).

::

    GET  /backends                         -> BackendList (every native model's backends, engine stats;
                                              each model's routing policy and counters)
    POST /backends/{id}/drain[?wait=S]     -> Backend (no new request routed to it; in-flight ones finish;
                                              ``wait``: answer once it has none in flight, or after S s)
    POST /backends/{id}/undrain            -> Backend (takes requests again)

``{id}`` is a backend's name (``backend-0``...; unique across models; it may hold slashes, as a served name
such as ``org/model`` gives ``org/model-backend-0``). A drain lasts across the backend's
restarts, until ``undrain``; it is this gateway's (each gateway sharing a backend drains its own link). While
every backend of a model is drained, its requests get 503 at once and ``/readyz`` is 503.

Errors (OpenAI's body, gateway/errors.py)::

    APIError
    ├── InvalidRequest (400, code invalid_parameter, param wait): ``wait`` not a number in [0, 300]
    ├── AuthenticationError / PermissionDenied (401 / 403): not the admin key
    └── NotFound (404, code backend_not_found, param backend_id): no backend has that name
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from backend.protocol import Stats
from gateway.backends.pool import BackendPool
from gateway.backends.request import BackendUnavailable
from gateway.backends.supervisor import BackendSupervisor
from gateway.errors import APIError, InvalidRequest, NotFound
from gateway.observability.record import get_record
from gateway.state import Gateway

MAX_WAIT_S = 300.0  # the longest ``?wait=`` of a drain, seconds
STATS_TIMEOUT_S = 2.0  # seconds one backend gets to answer GetStats for the listing
State = Literal["ready", "starting", "restarting", "unavailable", "stopped", "draining"]
Count = Annotated[int, msgspec.Meta(ge=0)]


class BackendEngineStats(msgspec.Struct, kw_only=True):
    """A backend's engine counters now (``backend.protocol.Stats``); blocks and tokens."""

    running: Count
    waiting: Count
    kv_blocks_used: Count
    kv_blocks_free: Count
    kv_blocks_total: Count
    kv_blocks_cached: Annotated[
        int, msgspec.Meta(ge=0, description="free blocks holding prefix-cache content")
    ]
    prefix_cache_queries: Annotated[int, msgspec.Meta(ge=0, description="prompt tokens looked up")]
    prefix_cache_hits: Annotated[int, msgspec.Meta(ge=0, description="prompt tokens served from cache")]
    prefix_cache_hit_rate: Annotated[
        float | None, msgspec.Meta(description="hits / queries since the backend started (null: none yet)")
    ]


class Backend(msgspec.Struct, kw_only=True):
    """One inference backend of a native model, as this gateway sees it."""

    object: Literal["backend"] = "backend"
    id: str
    model: str
    url: Annotated[str | None, msgspec.Meta(description="unix:/tcp:/tls: address; null: spawned here")]
    spawned: bool
    pid: int | None
    state: Annotated[State, msgspec.Meta(description="the supervisor's state; draining: drained and running")]
    draining: Annotated[bool, msgspec.Meta(description="drained by the operator (kept across restarts)")]
    drained: Annotated[bool, msgspec.Meta(description="draining and nothing in flight any more")]
    in_flight: Count
    restarts: Count
    last_error: str | None
    mode: Annotated[
        str | None,
        msgspec.Meta(
            description="compute dtype and weight formats (int4, mixed or dense), e.g. 'float32 int4'; null: not running"
        ),
    ] = None
    stats: BackendEngineStats | None = None  # null: not running, or no answer in time


class Routing(msgspec.Struct, kw_only=True):
    """One model's routing policy (``[backend] routing``) and how its requests went since the start."""

    model: str
    policy: Literal["prefix", "least-loaded"]
    prefix_blocks: Count
    max_waiting: Count
    routed_prefix: Annotated[int, msgspec.Meta(ge=0, description="requests sent to their preferred backend")]
    routed_fallback: Annotated[
        int, msgspec.Meta(ge=0, description="requests sent least-loaded instead (the load bound)")
    ]


class BackendList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Backend]
    routing: list[Routing]


def routing_object(model: str, pool: BackendPool) -> Routing:
    r = pool.router
    c = r.config
    return Routing(
        model=model,
        policy=c.policy,
        prefix_blocks=c.prefix_blocks,
        max_waiting=c.max_waiting,
        routed_prefix=r.routed_prefix,
        routed_fallback=r.routed_fallback,
    )


def _reply(obj: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(obj), 200, media_type="application/json")


def engine_stats(st: Stats) -> BackendEngineStats:
    """``BackendEngineStats`` of a backend's ``Stats``."""
    q, h = st.prefix_cache_queries, st.prefix_cache_hits
    return BackendEngineStats(
        running=st.running,
        waiting=st.waiting,
        kv_blocks_used=st.kv_blocks_used,
        kv_blocks_free=max(0, st.kv_blocks_total - st.kv_blocks_used),
        kv_blocks_total=st.kv_blocks_total,
        kv_blocks_cached=st.kv_blocks_cached,
        prefix_cache_queries=q,
        prefix_cache_hits=h,
        prefix_cache_hit_rate=h / q if q else None,
    )


def backend_object(
    model: str, pool: BackendPool, s: BackendSupervisor, stats: BackendEngineStats | None
) -> Backend:
    c = s.client
    in_flight = c.in_flight if c is not None else 0
    draining = s.name in pool.drained
    return Backend(
        id=s.name,
        model=model,
        url=None if s.spawn is not None else s.url,
        spawned=s.spawn is not None,
        pid=s.pid,
        state="draining" if draining and s.state == "ready" else s.state,  # type: ignore[arg-type]
        draining=draining,
        drained=draining and in_flight == 0,
        in_flight=in_flight,
        restarts=s.restarts,
        last_error=s.last_error,
        mode=f"{c.card.dtype} {c.card.weights}" if c is not None else None,
        stats=stats,
    )


async def _stats_of(s: BackendSupervisor) -> BackendEngineStats | None:
    c = s.client
    if c is None or not c.alive:
        return None
    try:
        return engine_stats(await c.get_stats(timeout=STATS_TIMEOUT_S))
    except BackendUnavailable:
        return None


class BackendAdmin:
    """The handlers; ``pools()`` gives ``(served model name, pool)`` of every native model, read per request."""

    def __init__(self, gw: Gateway, pools: Callable[[], list[tuple[str, BackendPool]]]) -> None:
        self.gw = gw
        self.pools = pools

    def find(self, request: Request) -> tuple[str, BackendPool, BackendSupervisor]:
        """The backend of the path's ``{id}``. Raises ``NotFound`` (404 ``backend_not_found``)."""
        name = request.path_params["backend_id"]
        for model, pool in self.pools():
            s = pool.supervisor(name)
            if s is not None:
                return model, pool, s
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise NotFound(f"No backend named '{shown}'.", param="backend_id", code="backend_not_found")

    async def list_backends(self, request: Request) -> Response:
        """GET /admin/v1/backends: every backend with its state and engine stats (asked of all at once), and
        each model's routing counters."""
        pools = self.pools()
        rows = [(model, pool, s) for model, pool in pools for s in pool.supervisors]
        stats: list[BackendEngineStats | None] = [None] * len(rows)

        async def ask(i: int, s: BackendSupervisor) -> None:
            stats[i] = await _stats_of(s)

        async with trio.open_nursery() as nursery:
            for i, (_, _, s) in enumerate(rows):
                nursery.start_soon(ask, i, s)
        data = [backend_object(m, p, s, st) for (m, p, s), st in zip(rows, stats, strict=True)]
        return _reply(BackendList(data=data, routing=[routing_object(m, p) for m, p in pools]))

    async def drain(self, request: Request) -> Response:
        """POST /admin/v1/backends/{id}/drain[?wait=S]: route no new request to it; with ``wait``, answer once
        nothing is in flight there (``drained: true``) or after S seconds (``drained: false``)."""
        wait = _wait_param(request)
        model, pool, s = self.find(request)
        pool.drain(s.name)
        if wait > 0:
            await pool.wait_drained(s.name, wait)
        return _reply(backend_object(model, pool, s, await _stats_of(s)))

    async def undrain(self, request: Request) -> Response:
        """POST /admin/v1/backends/{id}/undrain: route requests to it again."""
        model, pool, s = self.find(request)
        pool.undrain(s.name)
        return _reply(backend_object(model, pool, s, await _stats_of(s)))

    def guarded(self, fn: Callable) -> Callable:
        """``fn`` behind the admin check, its APIErrors answered as OpenAI error bodies."""

        async def endpoint(request: Request) -> Response:
            try:
                await self.gw.check_admin(request)
                return await fn(request)
            except APIError as e:
                get_record(request).set_error(e.type, e.code)
                return Response(
                    msgspec.json.encode(e.body()), e.status, e.headers, media_type="application/json"
                )

        endpoint.__name__, endpoint.__doc__ = fn.__name__, fn.__doc__
        return endpoint


def _wait_param(request: Request) -> float:
    """``?wait=`` seconds (default 0). Raises ``InvalidRequest`` (400): not a number in [0, MAX_WAIT_S]."""
    text = request.query_params.get("wait")
    if text is None:
        return 0.0
    try:
        wait = float(text)
    except ValueError:
        wait = math.nan
    if not 0 <= wait <= MAX_WAIT_S:
        raise InvalidRequest(
            f"wait must be seconds from 0 to {MAX_WAIT_S:g}", param="wait", code="invalid_parameter"
        )
    return wait


def backend_routes(gw: Gateway) -> list[BaseRoute]:
    """The routes above, relative to ``/admin/v1``, over the native models of ``gw.catalog``."""
    admin = BackendAdmin(gw, lambda: [(m.name, m.pool) for m in gw.catalog if m.pool is not None])
    return [
        Route("/backends", admin.guarded(admin.list_backends), methods=["GET"]),
        Route("/backends/{backend_id:path}/drain", admin.guarded(admin.drain), methods=["POST"]),
        Route("/backends/{backend_id:path}/undrain", admin.guarded(admin.undrain), methods=["POST"]),
    ]
