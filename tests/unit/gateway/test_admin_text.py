"""Admin API text: every string a body stores is valid Unicode text (no lone surrogate, which JSON's ``\\ud800``
escape can spell but UTF-8 cannot encode; no NUL in a name), else a 400 naming the field and nothing stored;
rows written by hand with such a value are still listed (escaped), found and deleted.

The admin routes of a real ``Tenants`` (SQLite) behind the auth middleware, served by hypercorn on loopback."""

from __future__ import annotations

import sqlite3

import pytest
from plugins.asgi_server import served
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount

from gateway.admin.routes import admin_routes
from gateway.middleware.auth import AuthMiddleware
from gateway.tenants import Tenants

ADMIN = "admin-test-secret-123"
A = {"authorization": f"Bearer {ADMIN}", "content-type": "application/json"}
LONE = "\\ud800"  # as the JSON body spells it


@pytest.fixture
async def admin(tmp_path):
    db = str(tmp_path / "g.db")
    async with Tenants(db, admin_key=ADMIN).running() as t:
        app = Starlette(
            routes=[Mount("/admin/v1", routes=admin_routes(t))],
            middleware=[Middleware(AuthMiddleware, tenants=t)],
        )
        async with served(app) as client:
            yield client, db


async def _refused(c, method: str, path: str, body: str, param: str) -> None:
    r = await c.request(method, "/admin/v1" + path, content=body.encode(), headers=A)
    assert r.status_code == 400, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "invalid_value"), (body, err)


async def test_text_that_is_not_valid_is_refused_naming_the_field_and_stores_nothing(admin):
    c, db = admin
    before = (await c.get("/admin/v1/tenants", headers=A)).json()["data"]
    await _refused(c, "POST", "/tenants", f'{{"name": "t", "models": ["ok", "a{LONE}"]}}', "models[1]")
    await _refused(
        c, "POST", "/tenants", f'{{"name": "t", "model_limits": {{"m{LONE}": {{"rpm": 1}}}}}}', "model_limits"
    )
    await _refused(c, "POST", "/tenants", f'{{"name": "t{LONE}"}}', "name")
    await _refused(c, "POST", "/tenants", '{"name": "t\\u0000x"}', "name")
    await _refused(c, "POST", "/tenants", '{"name": "t", "models": ["m\\u0000"]}', "models[0]")
    assert (await c.get("/admin/v1/tenants", headers=A)).json()["data"] == before  # nothing stored
    t = (await c.post("/admin/v1/tenants", json={"name": "t", "models": ["m"]}, headers=A)).json()
    await _refused(c, "PATCH", f"/tenants/{t['id']}", f'{{"models": ["{LONE}"]}}', "models[0]")
    await _refused(
        c, "PATCH", f"/tenants/{t['id']}", f'{{"model_limits": {{"{LONE}": {{}}}}}}', "model_limits"
    )
    bad_filter = f'{{"hooks": [{{"type": "blocklist", "name": "b", "patterns": ["x{LONE}"]}}]}}'
    await _refused(c, "PUT", f"/tenants/{t['id']}/filters", bad_filter, "filters.hooks[0].patterns[0]")
    await _refused(c, "POST", f"/tenants/{t['id']}/keys", f'{{"models": ["m{LONE}"]}}', "models[0]")
    await _refused(c, "POST", f"/tenants/{t['id']}/keys", '{"name": "k\\u0000"}', "name")
    k = (await c.post(f"/admin/v1/tenants/{t['id']}/keys", json={"name": "k"}, headers=A)).json()
    await _refused(c, "PATCH", f"/keys/{k['id']}", f'{{"models": ["{LONE}"]}}', "models[0]")
    r = await c.get(f"/admin/v1/tenants/{t['id']}", headers=A)
    assert r.status_code == 200 and (r.json()["models"], r.json()["model_limits"], r.json()["filters"]) == (
        ["m"],
        {},
        {},
    )
    [key] = (await c.get(f"/admin/v1/tenants/{t['id']}/keys", headers=A)).json()["data"]
    assert (key["name"], key["models"]) == ("k", None)
    with sqlite3.connect(db) as conn:  # and nothing reached the store's own columns either
        text = " ".join(str(v) for row in conn.execute("SELECT * FROM tenants") for v in row)
    assert "\\ud800" not in text and "\\u0000" not in text and "\x00" not in text


async def test_a_row_stored_with_a_lone_surrogate_is_listed_escaped_and_can_be_fixed(admin):
    c, db = admin
    t = (await c.post("/admin/v1/tenants", json={"name": "t"}, headers=A)).json()
    k = (await c.post(f"/admin/v1/tenants/{t['id']}/keys", json={"name": "k"}, headers=A)).json()
    with sqlite3.connect(db) as conn:  # written by hand, as a gateway that did not check text would have
        conn.execute(
            "UPDATE tenants SET models = ?, model_limits = ? WHERE id = ?",
            (f'["a{LONE}"]', f'{{"m{LONE}": {{"rpm": 5}}}}', t["id"]),
        )
        conn.execute("UPDATE api_keys SET models = ? WHERE id = ?", (f'["b{LONE}"]', k["id"]))
    r = await c.get("/admin/v1/tenants", headers=A)
    assert r.status_code == 200, r.text
    [row] = [x for x in r.json()["data"] if x["id"] == t["id"]]
    assert row["models"] == ["a\\ud800"] and list(row["model_limits"]) == ["m\\ud800"]  # the escape as text
    assert (await c.get(f"/admin/v1/tenants/{t['id']}", headers=A)).status_code == 200
    r = await c.get(f"/admin/v1/tenants/{t['id']}/keys", headers=A)
    assert r.status_code == 200 and r.json()["data"][0]["models"] == ["b\\ud800"]
    assert (await c.get(f"/admin/v1/keys/{k['id']}", headers=A)).status_code == 200
    r = await c.patch(f"/admin/v1/tenants/{t['id']}", json={"models": ["a"], "model_limits": {}}, headers=A)
    assert r.status_code == 200 and r.json()["models"] == ["a"]  # found, and fixed
    r = await c.delete(f"/admin/v1/keys/{k['id']}", headers=A)
    assert r.status_code == 200 and r.json()["revoked"] is True
