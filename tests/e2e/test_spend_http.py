"""``GET /admin/v1/spend`` and the store's failure policy over HTTP: the admin routes, the auth middleware and a
chat route billing through ``Tenants.admit`` (the real ledger), served by hypercorn on loopback, on SQLite and
on a real PostgreSQL; with PostgreSQL stopped, a cached key is served, the rest is a 503 ``store_unavailable``
with ``retry-after`` (never a 500), and service resumes when it is back."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from plugins.gateway_server import free_port
from plugins.postgres_server import create_database, restart_postgres, start_postgres, stop_postgres
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from gateway.admin.routes import admin_routes
from gateway.errors import APIError
from gateway.middleware.auth import AuthMiddleware
from gateway.tenants import Tenants

ADMIN = "admin-spend-secret-123"
A = {"authorization": f"Bearer {ADMIN}"}


def bearer(k: str) -> dict:
    return {"authorization": f"Bearer {k}"}


@asynccontextmanager
async def serving(t: Tenants):
    """An app of the admin routes and ``POST /chat`` (bills ``{"model", "completion"}``), on a free port."""

    async def chat(request: Request):
        body = await request.json()
        try:
            async with t.admit(
                request.state.principal, prompt_tokens=10, max_tokens=100, model=body["model"]
            ) as res:
                res.finish(completion_tokens=body["completion"], finish_reason="stop")
                return JSONResponse({"ok": True})
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    app = Starlette(
        routes=[Route("/chat", chat, methods=["POST"]), Mount("/admin/v1", routes=admin_routes(t))],
        middleware=[Middleware(AuthMiddleware, tenants=t)],
    )
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{free_port()}"]
    cfg.accesslog = cfg.errorlog = logging.getLogger("test.spend")
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, cfg, shutdown_trigger=done.wait))
        async with httpx.AsyncClient(base_url=binds[0], timeout=10) as client:
            yield client
        done.set()


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request, tmp_path) -> str:
    return str(tmp_path / "g.db") if request.param == "sqlite" else request.getfixturevalue("pg_database_url")


async def test_spend_by_tenant_key_model_and_day(location, tmp_path):
    async with Tenants(
        location, admin_key=ADMIN, create_default=False, spool_dir=str(tmp_path)
    ).running() as t:
        async with serving(t) as c:
            ta = (await c.post("/admin/v1/tenants", json={"name": "a"}, headers=A)).json()
            tb = (await c.post("/admin/v1/tenants", json={"name": "b"}, headers=A)).json()
            ka1 = (await c.post(f"/admin/v1/tenants/{ta['id']}/keys", json={}, headers=A)).json()
            ka2 = (await c.post(f"/admin/v1/tenants/{ta['id']}/keys", json={}, headers=A)).json()
            kb = (await c.post(f"/admin/v1/tenants/{tb['id']}/keys", json={}, headers=A)).json()
            for key, model, completion in (
                (ka1, "m1", 5),
                (ka1, "m2", 7),
                (ka2, "m1", 1),
                (kb, "m1", 40),
            ):
                r = await c.post(
                    "/chat", json={"model": model, "completion": completion}, headers=bearer(key["key"])
                )
                assert r.status_code == 200, r.text

            r = await c.get("/admin/v1/spend", headers=A)
            assert r.status_code == 200, r.text
            s = r.json()
            assert s["object"] == "spend" and s["group_by"] == "tenant" and s["since"] is None
            assert s["totals"] == {
                "requests": 4,
                "prompt_tokens": 40,
                "cached_tokens": 0,
                "completion_tokens": 53,
                "total_tokens": 93,
            }
            assert [(g["group"], g["total_tokens"], g["requests"]) for g in s["data"]] == [
                (tb["id"], 50, 1),
                (ta["id"], 43, 3),
            ]
            by_key = (await c.get("/admin/v1/spend?group_by=key&tenant_id=a", headers=A)).json()
            assert by_key["tenant_id"] == ta["id"]  # a name resolves to the id
            assert [(g["group"], g["completion_tokens"]) for g in by_key["data"]] == [
                (ka1["id"], 12),
                (ka2["id"], 1),
            ]
            by_model = (await c.get(f"/admin/v1/spend?group_by=model&key_id={ka1['id']}", headers=A)).json()
            assert {g["group"]: g["total_tokens"] for g in by_model["data"]} == {"m1": 15, "m2": 17}
            m1 = (await c.get("/admin/v1/spend?model=m1&group_by=day", headers=A)).json()
            assert (
                m1["totals"]["requests"] == 3 and len(m1["data"]) == 1 and len(m1["data"][0]["group"]) == 10
            )
            future = (await c.get("/admin/v1/spend?since=2999-01-01T00:00:00Z", headers=A)).json()
            assert future["totals"]["requests"] == 0 and future["data"] == []
            assert future["since"] == 32472144000.0
            past = (await c.get("/admin/v1/spend?until=2000-01-01", headers=A)).json()
            assert past["totals"]["total_tokens"] == 0

            for query, status, param in (
                ("group_by=week", 400, "group_by"),
                ("since=yesterday", 400, "since"),
                ("since=0001-01-01", 400, "since"),
                ("since=2000&until=1000", 400, "until"),
                ("tenant_id=nobody", 404, "tenant_id"),
            ):
                r = await c.get(f"/admin/v1/spend?{query}", headers=A)
                assert r.status_code == status and r.json()["error"]["param"] == param, r.text
                assert r.json()["error"]["code"]
            assert (await c.get("/admin/v1/spend", headers=bearer(ka1["key"]))).status_code == 403
            assert (await c.get("/admin/v1/spend")).status_code == 401


async def test_postgres_stopped_gets_503_never_500_and_resumes(tmp_path):
    handle, server = start_postgres(tmp_path / "pg")
    try:
        url = create_database(server)
        tenants = Tenants(url, admin_key=ADMIN, create_default=False, spool_dir=str(tmp_path), stale_s=60.0)
        async with tenants.running() as t, serving(t) as c:
            ta = (await c.post("/admin/v1/tenants", json={"name": "a"}, headers=A)).json()
            cached = (await c.post(f"/admin/v1/tenants/{ta['id']}/keys", json={}, headers=A)).json()["key"]
            other = (await c.post(f"/admin/v1/tenants/{ta['id']}/keys", json={}, headers=A)).json()["key"]
            chat = {"model": "m", "completion": 2}
            assert (await c.post("/chat", json=chat, headers=bearer(cached))).status_code == 200
            await trio.to_thread.run_sync(stop_postgres, handle)
            await trio.sleep(1.1)  # past the key cache's TTL without a feed
            statuses = []
            for _ in range(5):
                statuses.append((await c.post("/chat", json=chat, headers=bearer(cached))).status_code)
            assert statuses == [200] * 5  # the cached key is served; its rows wait in the spool
            for r in (
                await c.post("/chat", json=chat, headers=bearer(other)),
                await c.get("/admin/v1/tenants", headers=A),
                await c.get("/admin/v1/spend", headers=A),
            ):
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "store_unavailable" and r.headers["retry-after"] == "1"
            await trio.to_thread.run_sync(restart_postgres, handle)
            for _ in range(100):  # back without restarting anything
                r = await c.post("/chat", json=chat, headers=bearer(other))
                if r.status_code == 200:
                    break
                assert r.status_code == 503
                await trio.sleep(0.1)
            assert r.status_code == 200
            s = (await c.get("/admin/v1/spend", headers=A)).json()
            assert s["totals"]["requests"] == 7  # the spooled rows were written: none lost
    finally:
        stop_postgres(handle)
