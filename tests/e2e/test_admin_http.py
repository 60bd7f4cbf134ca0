"""Admin API and auth middleware over HTTP: a small starlette app (AuthMiddleware, the admin routes, /v1/usage,
/openapi.json and a fake chat route using ``admit``) served by real hypercorn on loopback."""

from __future__ import annotations

import logging
import socket
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from gateway.admin.routes import admin_routes, usage_routes
from gateway.errors import APIError
from gateway.middleware.auth import AuthMiddleware
from gateway.openapi import openapi_routes
from gateway.tenants import Tenants

ADMIN = "admin-test-secret-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_app(t: Tenants) -> Starlette:
    async def chat(request: Request):
        body = await request.json()
        try:
            async with t.admit(
                request.state.principal,
                prompt_tokens=len(str(body.get("messages"))),
                max_tokens=int(body.get("max_tokens", 16)),
                model=body.get("model"),
            ) as res:
                res.finish(completion_tokens=3, finish_reason="stop")
                return JSONResponse(
                    {"object": "chat.completion", "tenant": request.state.principal.tenant_name},
                    headers=res.headers,
                )
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def health(request: Request):
        return JSONResponse({"ok": True})

    routes = [
        Route("/healthz", health),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Mount("/admin/v1", routes=admin_routes(t)),
        *openapi_routes(),
        *usage_routes(t),
    ]
    return Starlette(routes=routes, middleware=[Middleware(AuthMiddleware, tenants=t)])


@asynccontextmanager
async def served(app):
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{free_port()}"]
    cfg.accesslog = logging.getLogger("test.access")
    cfg.access_log_format = '%(h)s "%(r)s" %(s)s q=%(q)s U=%(U)s'
    cfg.errorlog = logging.getLogger("test.error")
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, cfg, shutdown_trigger=done.wait))
        async with httpx.AsyncClient(base_url=binds[0], timeout=10) as client:
            yield client
        done.set()


@pytest.fixture
async def env(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    said: list[str] = []
    async with Tenants(str(tmp_path / "g.db"), admin_key=ADMIN, announce=said.append).running() as t:
        async with served(make_app(t)) as client:
            yield t, client, said


A = {"authorization": f"Bearer {ADMIN}"}


def bearer(k: str) -> dict:
    return {"authorization": f"Bearer {k}"}


def limits(**given) -> dict:
    """A whole limits object (what PUT .../limits takes): the given limits, the others unlimited."""
    return {"rpm": None, "tpm": None, "max_concurrent": None, "daily_tokens": None, **given}


async def test_admin_flow_and_security(env, caplog, capfd):
    t, c, said = env
    default_key = t.default_key
    # create two tenants with keys
    r = await c.post("/admin/v1/tenants", json={"name": "a", "limits": {"rpm": 100}}, headers=A)
    assert r.status_code == 201, r.text
    ta = r.json()
    assert ta["limits"]["rpm"] == 100 and ta["limits"]["tpm"] is None
    tb = (await c.post("/admin/v1/tenants", json={"name": "b"}, headers=A)).json()
    assert (await c.post("/admin/v1/tenants", json={"name": "b"}, headers=A)).status_code == 409
    ka = (await c.post(f"/admin/v1/tenants/{ta['id']}/keys", json={"name": "k"}, headers=A)).json()
    kb = (await c.post(f"/admin/v1/tenants/{tb['id']}/keys", json={}, headers=A)).json()
    key_a, key_b = ka["key"], kb["key"]
    assert ka["prefix"] == key_a[: len(ka["prefix"])]

    # keys are listed by prefix only
    lst = (await c.get(f"/admin/v1/tenants/{ta['id']}/keys", headers=A)).json()["data"]
    assert [k["prefix"] for k in lst] == [ka["prefix"]] and key_a not in str(lst)
    assert len((await c.get("/admin/v1/tenants", headers=A)).json()["data"]) == 3  # default + a + b

    # inference with tenant keys
    r = await c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 5}, headers=bearer(key_a))
    assert r.status_code == 200 and r.json()["tenant"] == "a"
    assert r.headers["x-ratelimit-limit-requests"] == "100" and r.headers[
        "x-ratelimit-remaining-requests"
    ] in ("99", "100")

    # missing / wrong key -> 401 OpenAI body, on known, aliased and unknown paths (no 404 before auth)
    for path in (
        "/v1/chat/completions",
        "/v1/chat/completions/",
        "/chat/completions",
        "/v1/nope",
        "/healthz/../v1/chat/completions",
        "/v1/models",
    ):
        for h in ({}, bearer("sk-gw-not-a-key"), {"authorization": key_a}):
            r = await c.post(path, json={}, headers=h)
            assert r.status_code == 401, (path, h, r.status_code)
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    # a key in the query string -> 401 even with a valid header
    for q in ("api_key", "key", "access_token"):
        r = await c.post(f"/v1/chat/completions?{q}={key_a}", json={}, headers=bearer(key_a))
        assert r.status_code == 401
    # a tenant key on admin routes -> 403; no/wrong key -> 401
    for method, path in (
        ("GET", "/admin/v1/tenants"),
        ("GET", f"/admin/v1/tenants/{tb['id']}/usage"),
        ("GET", f"/admin/v1/tenants/{tb['id']}/keys"),
        ("DELETE", f"/admin/v1/keys/{kb['id']}"),
        ("GET", "/v1/../admin/v1/tenants"),
        ("GET", "/admin/v1/unknown"),
    ):
        r = await c.request(method, path, headers=bearer(key_a))
        assert r.status_code == 403, (path, r.status_code)
        assert r.json()["error"]["message"]
        r = await c.request(method, path)
        assert r.status_code == 401
        r = await c.request(method, path, headers=bearer("wrong"))
        assert r.status_code == 401
    # tenant A sees only its own usage through /v1/usage; every tenant response has the rate-limit headers
    r = await c.get("/v1/usage", headers=bearer(key_a))
    assert r.headers["x-ratelimit-limit-requests"] == "100" and r.headers[
        "x-ratelimit-remaining-requests"
    ] in ("99", "100")
    assert r.status_code == 200 and r.json()["tenant_id"] == ta["id"] and r.json()["totals"]["requests"] == 1
    r = await c.get("/v1/usage", headers=bearer(key_b))
    assert r.json()["tenant_id"] == tb["id"] and r.json()["totals"]["requests"] == 0

    # public routes (but never with a credential in the URL)
    assert (await c.get("/healthz")).status_code == 200
    assert (await c.get(f"/healthz?key={key_a}")).status_code == 401
    spec = (await c.get("/openapi.json")).json()
    for p in (
        "/v1/chat/completions",
        "/admin/v1/tenants",
        "/admin/v1/tenants/{tenant_id}",
        "/admin/v1/tenants/{tenant_id}/keys",
        "/admin/v1/keys/{key_id}",
        "/admin/v1/tenants/{tenant_id}/limits",
        "/admin/v1/tenants/{tenant_id}/usage",
        "/admin/v1/tenants/{tenant_id}/filters",
    ):
        assert p in spec["paths"], p
    assert set(spec["paths"]["/admin/v1/tenants/{tenant_id}"]) >= {"get", "patch", "delete"}

    # per-key limits via PATCH /keys/{id}: apply at once
    r = await c.patch(f"/admin/v1/keys/{kb['id']}", json={"limits": {"rpm": 1}, "name": "b2"}, headers=A)
    assert r.status_code == 200 and r.json()["limits"]["rpm"] == 1 and r.json()["name"] == "b2"
    codes = [
        (await c.post("/v1/chat/completions", json={}, headers=bearer(key_b))).status_code for _ in range(2)
    ]
    assert codes == [200, 429]
    assert (await c.get(f"/admin/v1/keys/{kb['id']}", headers=A)).json()["prefix"] == kb["prefix"]
    assert (await c.patch("/admin/v1/keys/key_nope", json={}, headers=A)).status_code == 404

    # revoke B's key: 401 at once
    r = await c.delete(f"/admin/v1/keys/{kb['id']}", headers=A)
    assert r.status_code == 200 and r.json()["revoked_at"]
    r = await c.post("/v1/chat/completions", json={}, headers=bearer(key_b))
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]

    # usage via admin API
    u = (await c.get(f"/admin/v1/tenants/{ta['id']}/usage", params={"since": "2000-01-01"}, headers=A)).json()
    assert u["totals"]["requests"] == 1 and u["days"][0]["requests"] == 1
    u = (await c.get(f"/admin/v1/tenants/{ta['id']}/usage", params={"until": "2000-01-01"}, headers=A)).json()
    assert u["totals"]["requests"] == 0
    assert (
        await c.get(f"/admin/v1/tenants/{ta['id']}/usage", params={"since": "yesterday"}, headers=A)
    ).status_code == 400

    # keys never appear in logs or on stdout/stderr (only the one-time default-key announcement, captured)
    out, err = capfd.readouterr()
    server_logs = "\n".join(
        caplog.handler.format(r) for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))
    )  # the client logs its own URLs
    text = server_logs + out + err
    assert "REDACTED" in server_logs  # the access log saw the redacted query string
    for k in (key_a, key_b, default_key, ADMIN):
        assert k not in text
    assert len(said) == 1


async def test_limits_and_filters_via_admin(env):
    t, c, _ = env
    tn = (await c.post("/admin/v1/tenants", json={"name": "lim"}, headers=A)).json()
    key = (await c.post(f"/admin/v1/tenants/{tn['id']}/keys", headers=A)).json()["key"]
    r = await c.put(f"/admin/v1/tenants/{tn['id']}/limits", json=limits(rpm=2), headers=A)
    assert r.status_code == 200 and r.json()["rpm"] == 2
    assert (
        await c.put(f"/admin/v1/tenants/{tn['id']}/limits", json=limits(rpm=-3), headers=A)
    ).status_code == 400
    assert (
        await c.put(f"/admin/v1/tenants/{tn['id']}/limits", json={**limits(), "bogus": 1}, headers=A)
    ).status_code == 400
    assert (await c.get("/admin/v1/tenants/lim/limits", headers=A)).json()["rpm"] == 2  # name works as id
    codes = [
        (await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))).status_code
        for _ in range(4)
    ]
    assert codes == [200, 200, 429, 429]
    r = await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))
    e = r.json()["error"]
    assert e["code"] == "rate_limit_exceeded" and e["type"] == "requests"
    assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) > 0
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    # raising the limit applies at once
    await c.put(f"/admin/v1/tenants/{tn['id']}/limits", json=limits(rpm=10), headers=A)
    assert (
        await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))
    ).status_code == 200
    # disabling the tenant: 401 at once; PATCH back
    r = await c.patch(f"/admin/v1/tenants/{tn['id']}", json={"disabled": True}, headers=A)
    assert r.json()["disabled"] is True
    assert (
        await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))
    ).status_code == 401
    await c.patch(f"/admin/v1/tenants/{tn['id']}", json={"disabled": False}, headers=A)
    assert (
        await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))
    ).status_code == 200

    # filters: opaque JSON, validated by gateway.filters.parse_config
    assert (await c.get(f"/admin/v1/tenants/{tn['id']}/filters", headers=A)).json() == {}
    r = await c.put(f"/admin/v1/tenants/{tn['id']}/filters", content=b"{not json", headers=A)
    assert r.status_code == 400
    r = await c.put(f"/admin/v1/tenants/{tn['id']}/filters", json={"hooks": "nonsense"}, headers=A)
    assert r.status_code == 400 and r.json()["error"]["param"] == "filters"
    r = await c.put(f"/admin/v1/tenants/{tn['id']}/filters", json={}, headers=A)
    assert r.status_code == 200
    p = await t.authenticate([(b"authorization", f"Bearer {key}".encode())])
    assert p.filters == {}

    # delete: gone, keys revoked
    assert (await c.delete(f"/admin/v1/tenants/{tn['id']}", headers=A)).json()["deleted"] is True
    assert (await c.get(f"/admin/v1/tenants/{tn['id']}", headers=A)).status_code == 404
    assert (
        await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))
    ).status_code == 401
    # the name can be reused
    assert (await c.post("/admin/v1/tenants", json={"name": "lim"}, headers=A)).status_code == 201


async def test_concurrent_http_admissions_exact(env):
    t, c, _ = env
    tn = (await c.post("/admin/v1/tenants", json={"name": "burst", "limits": {"rpm": 10}}, headers=A)).json()
    key = (await c.post(f"/admin/v1/tenants/{tn['id']}/keys", headers=A)).json()["key"]
    codes: list[int] = []
    heads: list = []

    async def one():
        r = await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))
        codes.append(r.status_code)
        if r.status_code == 429:
            heads.append(r.headers)

    async with trio.open_nursery() as n:
        for _ in range(50):
            n.start_soon(one)
    assert codes.count(200) == 10 and codes.count(429) == 40
    assert all("retry-after" in h and "x-ratelimit-reset-requests" in h for h in heads)


async def test_admin_api_disabled_without_admin_key(tmp_path):
    async with Tenants(str(tmp_path / "g.db"), admin_key=None, announce=lambda s: None).running() as t:
        async with served(make_app(t)) as c:
            assert (await c.get("/admin/v1/tenants", headers=bearer("anything"))).status_code == 401
            assert (await c.get("/admin/v1/tenants", headers=bearer(t.default_key))).status_code == 403


async def test_limits_put_takes_the_whole_object_patch_a_part(env):
    """An empty or partial PUT .../limits used to remove every limit it did not name; now PUT takes the whole
    object (400 naming the first missing field, nothing changed) and PATCH changes only what it names."""
    t, c, _ = env
    r = await c.post(
        "/admin/v1/tenants",
        json={"name": "typed", "limits": {"rpm": 5, "tpm": 100, "window_s": 30}},
        headers=A,
    )
    url = f"/admin/v1/tenants/{r.json()['id']}/limits"
    before = (await c.get(url, headers=A)).json()
    assert before == {"rpm": 5, "tpm": 100, "max_concurrent": None, "daily_tokens": None, "window_s": 30.0}
    r = await c.put(url, headers=A)  # no body at all: a PUT always says what it sets
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    for kw, param in (
        ({"json": {}}, "rpm"),
        ({"json": {"rpm": 1, "tpm": 2}}, "max_concurrent"),
        ({"json": {"rpm": 1, "tpm": 2, "max_concurrent": 3}}, "daily_tokens"),
    ):
        r = await c.put(url, headers=A, **kw)
        assert r.status_code == 400, (kw, r.text)
        e = r.json()["error"]
        assert (e["param"], e["code"], e["type"]) == (
            param,
            "missing_required_parameter",
            "invalid_request_error",
        )
        assert param in e["message"]
    for body, param, code in (
        ({**limits(), "rpm": "x"}, "rpm", "invalid_type"),
        ({**limits(), "daily_tokens": 1.5}, "daily_tokens", "invalid_type"),
        ({**limits(), "tpm": -1}, "tpm", "invalid_value"),
        ({**limits(), "tpm": 2**53}, "tpm", "invalid_value"),  # beyond int64-safe storage
        ({**limits(), "window_s": 0}, "window_s", "invalid_value"),
        ({**limits(), "rpm": True}, "rpm", "invalid_type"),
        ({**limits(), "burst": 3}, "burst", "unknown_parameter"),
    ):
        r = await c.put(url, json=body, headers=A)
        assert r.status_code == 400, (body, r.text)
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), (body, r.text)
    r = await c.put(url, json=[1, 2], headers=A)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"
    assert (await c.get(url, headers=A)).json() == before  # no failed PUT changed anything

    r = await c.patch(url, json={"tpm": 500}, headers=A)
    assert r.status_code == 200 and r.json() == {**before, "tpm": 500}
    assert (await c.patch(url, json={}, headers=A)).json() == {**before, "tpm": 500}
    # a PATCH with no body changes nothing by accident: it is a 400 (as on the tenant and the key)
    tid = url.split("/")[-2]
    kid = (await c.post(f"/admin/v1/tenants/{tid}/keys", headers=A)).json()["id"]  # no body: defaults
    for target in (url, f"/admin/v1/tenants/{tid}", f"/admin/v1/keys/{kid}"):
        r = await c.patch(target, headers=A)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (target, r.text)
    assert (await c.get(url, headers=A)).json() == {**before, "tpm": 500}
    assert (await c.patch(url, json={"rpm": None}, headers=A)).json()["rpm"] is None
    r = await c.patch(url, json={"rpm": "many"}, headers=A)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rpm"
    r = await c.put(url, json=limits(rpm=7), headers=A)  # whole object; window_s absent: the current stays
    assert r.json() == {**limits(rpm=7), "window_s": 30.0}
    r = await c.put(url, json=limits(max_concurrent=2, window_s=60), headers=A)
    assert r.json() == {**limits(max_concurrent=2), "window_s": 60.0}


async def test_tenant_and_key_bodies_are_typed(env):
    t, c, _ = env
    for body, param, code in (
        ({}, "name", "missing_required_parameter"),
        ({"name": 5}, "name", "invalid_type"),
        ({"name": ""}, "name", "invalid_value"),
        ({"name": "   "}, "name", "invalid_value"),
        ({"name": "x" * 129}, "name", "invalid_value"),
        ({"name": "z", "limits": {"rpm": -1}}, "limits.rpm", "invalid_value"),
        ({"name": "z", "limits": {"rpm": 1, "bogus": 1}}, "limits.bogus", "unknown_parameter"),
        ({"name": "z", "limits": [1]}, "limits", "invalid_type"),
        ({"name": "z", "disabled": "yes"}, "disabled", "invalid_type"),
        ({"name": "z", "colour": "red"}, "colour", "unknown_parameter"),
    ):
        r = await c.post("/admin/v1/tenants", json=body, headers=A)
        assert r.status_code == 400, (body, r.text)
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), (body, r.text)
    assert [x["name"] for x in (await c.get("/admin/v1/tenants", headers=A)).json()["data"]] == ["default"]
    r = await c.post("/admin/v1/tenants", json={"name": " z ", "disabled": True}, headers=A)
    assert r.status_code == 201 and (r.json()["name"], r.json()["disabled"]) == ("z", True)
    tid = r.json()["id"]
    assert r.json()["limits"] == {**limits(), "window_s": 60.0}
    for body, param in (
        ({"disabled": 1}, "disabled"),
        ({"name": None}, "name"),
        ({"filters": {"hooks": 3}}, "filters"),
    ):
        r = await c.patch(f"/admin/v1/tenants/{tid}", json=body, headers=A)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = await c.patch(f"/admin/v1/tenants/{tid}", json={"limits": {"rpm": 3}}, headers=A)
    assert r.status_code == 200 and r.json()["limits"]["rpm"] == 3 and r.json()["disabled"] is True

    for body, param in (
        ({"limits": {"tpm": "x"}}, "limits.tpm"),
        ({"name": 3}, "name"),
        ({"expires_at": {}}, "expires_at"),
    ):
        r = await c.post(f"/admin/v1/tenants/{tid}/keys", json=body, headers=A)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = await c.post(f"/admin/v1/tenants/{tid}/keys", json={"limits": {"rpm": 2}}, headers=A)
    assert r.status_code == 201 and r.json()["limits"] == {**limits(rpm=2), "window_s": 60.0}
    kid = r.json()["id"]
    r = await c.patch(f"/admin/v1/keys/{kid}", json={"limits": {"bogus": 1}}, headers=A)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limits.bogus"
    r = await c.patch(f"/admin/v1/keys/{kid}", json={"limits": None, "name": "k2"}, headers=A)
    assert r.status_code == 200 and (r.json()["limits"], r.json()["name"]) == (None, "k2")

    # PUT filters replaces the config: it needs a body (an empty one used to wipe it)
    await c.put(f"/admin/v1/tenants/{tid}/filters", json={"hooks": []}, headers=A)
    r = await c.put(f"/admin/v1/tenants/{tid}/filters", headers=A)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert (await c.get(f"/admin/v1/tenants/{tid}/filters", headers=A)).json() == {"hooks": []}
    r = await c.post("/admin/v1/tenants", content=b"x" * (256 * 1024 + 1), headers=A)
    assert r.status_code == 413


async def test_lease_clear_frees_a_tenants_concurrency_slots(env):
    """``DELETE /admin/v1/tenants/{id}/leases`` frees the slots of the tenant and of its keys at once and says
    how many; the next request is admitted; admin key only; unknown tenant 404."""
    t, c, _ = env
    tn = (
        await c.post("/admin/v1/tenants", json={"name": "stuck", "limits": {"max_concurrent": 1}}, headers=A)
    ).json()
    key = (
        await c.post(f"/admin/v1/tenants/{tn['id']}/keys", json={"limits": {"max_concurrent": 1}}, headers=A)
    ).json()["key"]
    principal = await t.authenticate([(b"authorization", f"Bearer {key}".encode())])
    stuck = await t.admission.reserve(principal, prompt_tokens=1, max_tokens=1)  # a slot nobody frees
    r = await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert (await c.delete(f"/admin/v1/tenants/{tn['id']}/leases", headers=bearer(key))).status_code == 403
    assert (await c.delete(f"/admin/v1/tenants/{tn['id']}/leases")).status_code == 401
    r = await c.delete("/admin/v1/tenants/stuck/leases", headers=A)  # by name
    assert r.status_code == 200, r.text
    assert r.json() == {"tenant_id": tn["id"], "cleared": 1, "key_leases_cleared": 1}
    r = await c.post("/v1/chat/completions", json={"messages": []}, headers=bearer(key))
    assert r.status_code == 200, r.text
    await t.admission.close(stuck)  # its late release frees nothing of anyone else's
    r = await c.delete(f"/admin/v1/tenants/{tn['id']}/leases", headers=A)
    assert r.json() == {"tenant_id": tn["id"], "cleared": 0, "key_leases_cleared": 0}
    r = await c.delete("/admin/v1/tenants/tn_nope/leases", headers=A)
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
